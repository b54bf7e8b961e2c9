"""firmware_tools: ELF images, flash geometry checks and the STM32 UART bootloader (AN3155).

A library first and a CLI second; it never imports edge_agent.
"""

__all__: list[str] = []
