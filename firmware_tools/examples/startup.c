/*
 * Cortex-M4 start-up for the STM32F405 example: vector table, .data copy, .bss clear.
 *
 * The reset handler copies .data from its load address in flash (LMA, _sidata) to its run
 * address in RAM (VMA, _sdata.._edata) and zeroes .bss, then calls main(). No C library.
 */
#include <stdint.h>

extern uint32_t _sidata, _sdata, _edata, _sbss, _ebss, _estack;
int main(void);

void Reset_Handler(void);
void Default_Handler(void);

__attribute__((noreturn)) void Reset_Handler(void)
{
    uint32_t *src = &_sidata;
    uint32_t *dst = &_sdata;
    while (dst < &_edata) {
        *dst++ = *src++;
    }
    for (dst = &_sbss; dst < &_ebss;) {
        *dst++ = 0;
    }
    main();
    for (;;) {
    }
}

void Default_Handler(void)
{
    for (;;) {
    }
}

/* Core exceptions only: the example enables no interrupt. */
__attribute__((section(".isr_vector"), used)) void (*const vector_table[16])(void) = {
    (void (*)(void))&_estack, /* initial stack pointer */
    Reset_Handler,            /* reset */
    Default_Handler,          /* NMI */
    Default_Handler,          /* HardFault */
    Default_Handler,          /* MemManage */
    Default_Handler,          /* BusFault */
    Default_Handler,          /* UsageFault */
    0, 0, 0, 0,               /* reserved */
    Default_Handler,          /* SVCall */
    Default_Handler,          /* DebugMonitor */
    0,                        /* reserved */
    Default_Handler,          /* PendSV */
    Default_Handler,          /* SysTick */
};
