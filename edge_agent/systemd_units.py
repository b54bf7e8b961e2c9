"""The systemd unit, socket, sysusers and tmpfiles texts, rendered for one installation.

Invariants owned here:
- One source of truth: `render_units()` produces every file; `systemd/` in the source tree is
  its output for the packaged layout (/usr/bin/edge-agent), and a test keeps the two identical.
- Exit status 78 (bad configuration) never restarts the service (RestartPreventExitStatus=78).
- The service runs as the dedicated user, with dialout for the UART and only CAP_IPC_LOCK (so
  it can mlock weights without root) and CAP_SYS_RESOURCE (so Linux < 6.5 lets it arm PSI
  triggers; the daemon drops it after arming), bounding and ambient.
- ProtectControlGroups= stays off: Delegate=yes hands the daemon a cgroup subtree to write.
- RuntimeDirectoryPreserve=yes: the socket unit's listening socket lives in /run/edge-agent and
  must survive a service restart.
- Network: with server.tcp off (UnitOptions.tcp False) the service has no network at all
  (PrivateNetwork=yes, AF_UNIX only); with it on, AF_INET/AF_INET6 to localhost only
  (IPAddressDeny=any, IPAddressAllow=localhost). SystemCallFilter=@system-service and
  MemoryDenyWriteExecute=yes hold for both engines (checked under strace and PR_SET_MDWE).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "UnitOptions",
    "render_units",
    "UNIT_FILES",
    "SYSUSERS_FILE",
    "TMPFILES_FILE",
    "PACKAGED_EXEC_START",
    "SOCKET_PATH",
]

UNIT_FILES = ("edge-agent.service", "edge-agent.socket")
SYSUSERS_FILE = "edge-agent.sysusers.conf"  # installed as /etc/sysusers.d/edge-agent.conf
TMPFILES_FILE = "edge-agent.tmpfiles.conf"  # installed as /etc/tmpfiles.d/edge-agent.conf
PACKAGED_EXEC_START = "/usr/bin/edge-agent serve"
SOCKET_PATH = "/run/edge-agent/edge-agent.sock"


@dataclass(frozen=True)
class UnitOptions:
    exec_start: str = PACKAGED_EXEC_START
    user: str = "edge-agent"
    group: str = "edge-agent"
    # "yes" hides /home, /root and /run/user; "read-only" when the installation lives there.
    protect_home: str = "yes"
    watchdog_sec: int = 30
    timeout_start_sec: int = 300
    timeout_stop_sec: int = 60
    # server.tcp is configured: AF_INET/AF_INET6 allowed, IP traffic to localhost only.
    # Off (the default): Unix sockets only, no network namespace access at all.
    tcp: bool = False


_SERVICE = """\
# edge-agent: local LLM inference and MCU flashing daemon.
# Written by `edge-agent systemd install`; re-run it after moving the installation.
[Unit]
Description=edge-agent inference and flashing daemon
Documentation=man:systemd.exec(5) man:systemd.service(5)
Requires=edge-agent.socket
After=edge-agent.socket network.target
StartLimitIntervalSec=300
StartLimitBurst=5

[Service]
Type=notify
NotifyAccess=main
ExecStart={exec_start}
User={user}
Group={group}
SupplementaryGroups=dialout
# READY=1 comes only after preloaded weights are pinned; the daemon sends EXTEND_TIMEOUT_USEC=
# while it prepares a model, so this bound is for a stuck start, not a slow one.
TimeoutStartSec={timeout_start_sec}
# SIGTERM starts a graceful drain (server.drain_timeout_s); the rest stays journaled.
TimeoutStopSec={timeout_stop_sec}
KillMode=mixed
WatchdogSec={watchdog_sec}
Restart=on-failure
RestartSec=2
# 78 = bad configuration: restarting cannot fix it.
RestartPreventExitStatus=78
# The daemon puts itself in a supervisor leaf and each model runner in its own cgroup.
Delegate=yes
LimitMEMLOCK=infinity
# Descriptors: the HTTP server caps connections (256 + 8 for /health) far below this, so
# a client flood gets 503s and never starves the journal, runners or the UART of descriptors.
LimitNOFILE=8192
StateDirectory=edge-agent
StateDirectoryMode=0750
RuntimeDirectory=edge-agent
RuntimeDirectoryMode=0755
RuntimeDirectoryPreserve=yes
ConfigurationDirectory=edge-agent
UMask=0027
# Hardening. No ProtectControlGroups= (the delegated subtree is written), no PrivateDevices=
# (the UART is a device), no ProcSubset=pid (/proc/pressure/memory is watched), no
# PrivateUsers= (CAP_IPC_LOCK must count in the host's user namespace for mlock).
# CAP_IPC_LOCK: mlock the model weights without root.
# CAP_SYS_RESOURCE: Linux < 6.5 lets a process open memory.pressure for writing (arm a PSI
# trigger) only with it. The daemon drops it right after arming (armed triggers keep working),
# so runners never get it. Remove it on kernels >= 6.5 (unprivileged triggers, 2 s windows) or
# with systemd >= 254 (MemoryPressureWatch= arms it). Without it, Linux < 6.5 means polling.
CapabilityBoundingSet=CAP_IPC_LOCK CAP_SYS_RESOURCE
AmbientCapabilities=CAP_IPC_LOCK CAP_SYS_RESOURCE
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome={protect_home}
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectClock=yes
ProtectHostname=yes
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
ProtectProc=invisible
PrivateMounts=yes
# Every system call the daemon and its runners make (numpy and llama.cpp engines, mlock, PSI
# triggers, cgroup delegation, serial ports) is in @system-service; anything else fails EPERM.
SystemCallFilter=@system-service
SystemCallErrorNumber=EPERM
# Neither numpy/OpenBLAS nor llama.cpp generate code at run time (no W+X mapping).
MemoryDenyWriteExecute=yes
{network}SystemCallArchitectures=native

[Install]
WantedBy=multi-user.target
"""

_NETWORK_UNIX = """\
# server.tcp is off: Unix sockets only (re-run `edge-agent systemd install` after setting it).
PrivateNetwork=yes
IPAddressDeny=any
RestrictAddressFamilies=AF_UNIX
"""

_NETWORK_TCP = """\
# server.tcp is set: loopback TCP, nothing else.
IPAddressDeny=any
IPAddressAllow=localhost
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
"""

_SOCKET = """\
# edge-agent: the HTTP API socket, activated by systemd (LISTEN_FDS) so clients can connect
# while the daemon starts or restarts.
[Unit]
Description=edge-agent API socket

[Socket]
ListenStream={socket_path}
SocketUser=root
SocketGroup={group}
SocketMode=0660
DirectoryMode=0755
FileDescriptorName=api
RemoveOnStop=yes

[Install]
WantedBy=sockets.target
"""

_SYSUSERS = """\
# edge-agent: the service user (systemd-sysusers, see sysusers.d(5)).
# Type Name       ID Description          Home
u {user} - "edge-agent daemon" /var/lib/edge-agent
# UART access for the serial transport and flashing.
m {user} dialout
"""

_TMPFILES = """\
# edge-agent: directories (systemd-tmpfiles, see tmpfiles.d(5)).
# Type Path                Mode User       Group      Age
d /etc/edge-agent          0755 root       root       -
d /var/lib/edge-agent      0750 {user} {group} -
d /run/edge-agent          0755 {user} {group} -
"""


def render_units(options: UnitOptions | None = None) -> dict[str, str]:
    """File name -> contents for the service, socket, sysusers and tmpfiles files."""
    opts = options or UnitOptions()
    values = {
        "exec_start": opts.exec_start,
        "user": opts.user,
        "group": opts.group,
        "protect_home": opts.protect_home,
        "watchdog_sec": opts.watchdog_sec,
        "timeout_start_sec": opts.timeout_start_sec,
        "timeout_stop_sec": opts.timeout_stop_sec,
        "socket_path": SOCKET_PATH,
        "network": _NETWORK_TCP if opts.tcp else _NETWORK_UNIX,
    }
    return {
        "edge-agent.service": _SERVICE.format(**values),
        "edge-agent.socket": _SOCKET.format(**values),
        SYSUSERS_FILE: _SYSUSERS.format(**values),
        TMPFILES_FILE: _TMPFILES.format(**values),
    }
