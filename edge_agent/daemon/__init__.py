"""The daemon: composition root (wiring, signals, sd_notify, watchdog, runner supervision)."""
