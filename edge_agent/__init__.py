"""edge-agent: local LLM inference, memory policy and MCU flashing for ARM Linux boards."""

__version__ = "0.1.0"
__all__ = ["__version__"]
