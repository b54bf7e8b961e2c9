/*
 * Example firmware for the STM32F405 (QEMU machine `netduinoplus2`): prints one line on USART1.
 *
 * The line lives in .data (a writable, initialised array), so it reaches the UART only if the
 * reset handler copied .data from flash (LMA) to RAM (VMA): the output proves the copy.
 * `bss_check` lives in .bss and must read 0. Clock set-up is the reset default (HSI 16 MHz);
 * BRR below gives 115200 baud on real silicon, QEMU ignores it.
 */
#include <stdint.h>

#define REG(addr) (*(volatile uint32_t *)(addr))

#define RCC_AHB1ENR REG(0x40023830u)
#define RCC_APB2ENR REG(0x40023844u)
#define GPIOA_MODER REG(0x40020000u)
#define GPIOA_AFRH REG(0x40020024u)
#define USART1_SR REG(0x40011000u)
#define USART1_DR REG(0x40011004u)
#define USART1_BRR REG(0x40011008u)
#define USART1_CR1 REG(0x4001100Cu)

#define USART_SR_TXE (1u << 7)
#define USART_SR_TC (1u << 6)
#define USART_CR1_UE (1u << 13)
#define USART_CR1_TE (1u << 3)

#ifndef BLOB_SIZE
#define BLOB_SIZE 0
#endif

char message[] = "edge-agent example firmware: .data copied from flash\r\n";
uint32_t bss_check;

#if BLOB_SIZE > 0
/* Padding for size tests: constant data in flash that the program reads. */
const uint8_t blob[BLOB_SIZE] = {1, 2, 3, 4};
#define BLOB_AT(i) (*(const volatile uint8_t *)&blob[(i)])
#endif

static void uart_init(void)
{
    RCC_AHB1ENR |= 1u << 0;                                   /* GPIOA clock */
    RCC_APB2ENR |= 1u << 4;                                   /* USART1 clock */
    GPIOA_MODER = (GPIOA_MODER & ~(3u << 18)) | (2u << 18);   /* PA9: alternate function */
    GPIOA_AFRH = (GPIOA_AFRH & ~(0xFu << 4)) | (7u << 4);     /* PA9: AF7 = USART1_TX */
    USART1_BRR = 0x8B;                                        /* 16 MHz / 115200 */
    USART1_CR1 = USART_CR1_UE | USART_CR1_TE;
}

static void uart_putc(char c)
{
    while ((USART1_SR & USART_SR_TXE) == 0) {
    }
    USART1_DR = (uint32_t)(uint8_t)c;
}

static void uart_puts(const char *s)
{
    while (*s != '\0') {
        uart_putc(*s++);
    }
}

int main(void)
{
    uart_init();
    if (bss_check != 0) {
        uart_puts("edge-agent example firmware: .bss not zeroed\r\n");
    }
#if BLOB_SIZE > 0
    if (BLOB_AT(BLOB_SIZE - 1) != 0 || BLOB_AT(0) != 1) {
        uart_puts("edge-agent example firmware: blob corrupt\r\n");
    }
#endif
    uart_puts(message);
    while ((USART1_SR & USART_SR_TC) == 0) {
    }
    for (;;) {
    }
}
