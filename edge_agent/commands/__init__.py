"""Sub-commands of the `edge-agent` CLI; each module exposes `register(subparsers)`."""
