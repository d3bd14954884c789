"""Launch a real `tritonserver` on a model repository, wait until it serves, stop it cleanly.

The binary usually comes from the `nvidia-pytriton` wheel (Triton 2.51). Its Python backend
runs every model.py in a `triton_python_backend_stub` process, and these facts about that
stub (checked against the wheel) shape this module:
- the wheel ships one stub per Python version, but Triton only looks for it next to
  `libtriton_python.so`; we assemble a private backend directory of symlinks rather than
  touch site-packages;
- the stub embeds Python in isolated mode (PYTHONPATH/PYTHONHOME are ignored) and finds its
  environment by looking `python3` up on PATH, so this interpreter's bin directory goes first
  on PATH: that is what lets model.py `import dflash_trt` from this venv;
- the stub links `libpython3.X.so.1.0` by soname and would otherwise pick up a system
  libpython of another patch release;
- Triton 2.51's stub mis-reads tensors under numpy 2 (outputs come back empty, BYTES inputs
  kill the stub), so the bundled server is refused when the stub would import numpy >= 2,
  whatever PYTHONPATH puts first for us.

How a server fails and stops, which shapes the rest:
- Triton 2.51 never notices that a stub died: the server keeps reporting ready while that
  model's requests hang. `watch()` returns when tritonserver or any of its stubs exits.
- every stub maps a POSIX shared-memory region that nothing removes when the stub is killed;
  each server gets its own region prefix, so that its regions, and only those, are removed
  once it is gone.
- Triton cannot drain an ensemble stream: once it has SIGTERM it refuses the stream's next
  postprocessing step, and the request stalls until the exit timeout cuts it. So the dflash
  model drains, and stops tritonserver itself when nothing is left in flight (`stop()`).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.config import cache_dir
from dflash_trt.errors import ServeError

LOG_TAIL_LINES = 40
STUB = "triton_python_backend_stub"
SHM_DIR = Path("/dev/shm")
DRAIN_TIMEOUT_S = 10.0  # how long stop() lets the requests in flight finish
# Triton's exit timeout: once it has SIGTERM (the drain is over by then), the time it gets to
# unload the models (model.finalize runs) and exit; then it gives up, and we kill what is left.
EXIT_GRACE_S = 5
DRAIN_MODELS = ("dflash",)  # models whose stub drains on SIGTERM; see serving/dflash_model.py
# The admin APIs: loading models from the repository is code execution; the others change or
# expose the server's state. Health, metadata, statistics and inference stay open.
ADMIN_APIS = "model-repository,shared-memory,logging,trace"
ADMIN_HEADER = "dflash-trt-admin-key"  # gRPC clients send it as triton-grpc-protocol-dflash-trt-admin-key


@dataclass(frozen=True)
class Endpoints:
    http: str  # "http://127.0.0.1:8000"
    grpc: str  # "127.0.0.1:8001" (tritonclient.grpc takes host:port)
    metrics: str  # "http://127.0.0.1:8002/metrics"


def find_tritonserver(explicit: Path | None = None) -> Path:
    """The tritonserver to run: `explicit`, else the one on PATH, else the nvidia-pytriton one."""
    if explicit is not None:
        explicit = Path(explicit).expanduser()
        if not (explicit.is_file() and os.access(explicit, os.X_OK)):
            raise ServeError(f"tritonserver {explicit} does not exist or is not an executable file")
        return explicit
    on_path = shutil.which("tritonserver")
    if on_path:
        return Path(on_path)
    root = _bundled_root()
    if root is not None and (root / "bin" / "tritonserver").is_file():
        return root / "bin" / "tritonserver"
    bundled = root / "bin" / "tritonserver" if root else "nvidia-pytriton (not installed)"
    raise ServeError(
        f"no tritonserver found: tried PATH and {bundled}; "
        "install nvidia-pytriton or give the binary with --tritonserver"
    )


def check_ports_free(host: str, ports) -> None:
    """Raise ServeError naming the first port that a server could not listen on."""
    ports = list(ports)
    if len(set(ports)) != len(ports):
        raise ServeError(f"the serving ports must differ, got {ports}")
    for port in ports:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            # SO_REUSEADDR, as servers use it: a port in TIME_WAIT is free, a listener is not.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as e:
                raise ServeError(f"port {port} on {host} is not available: {e.strerror}") from None


class TritonServer:
    """A tritonserver child process; `with TritonServer(repo) as server:` starts and stops it.

    The server runs in its own process group (so stopping it also ends the Python backend
    stubs) and gets SIGTERM if the process that started it dies. That parent-death signal is
    tied to the starting *thread*: call start() from a thread that outlives the server.

    `host` is the address all three endpoints bind (0.0.0.0: every interface). With an
    `admin_key`, Triton's ADMIN_APIS answer only requests that carry it in ADMIN_HEADER.
    """

    def __init__(self, repository: Path, *, http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, host: str = "127.0.0.1", tritonserver: Path | None = None,
                 log_path: Path | None = None, extra_args=(), env: dict | None = None,
                 check_ports: bool = True, admin_key: str | None = None,
                 drain_timeout: float = DRAIN_TIMEOUT_S):
        self.repository = Path(repository).expanduser().resolve()
        self.ports = (http_port, grpc_port, metrics_port)
        self.host = host
        self.admin_key = admin_key
        self.drain_timeout = drain_timeout
        self.shm_prefix = f"dflash_trt_{secrets.token_hex(6)}_"  # this server's regions, see _reap
        self.tritonserver = tritonserver
        self.log_path = Path(log_path) if log_path is not None else None
        self.extra_args = tuple(extra_args)
        self.env = dict(env or {})
        self.check_ports = check_ports  # False lets tritonserver itself meet a busy port
        self.endpoints: Endpoints | None = None
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, timeout: float = 120.0) -> Endpoints:
        if self._proc is not None:
            raise ServeError("this TritonServer was already started")
        if not self.repository.is_dir():
            raise ServeError(f"model repository {self.repository} is not a directory")
        if self.check_ports:
            check_ports_free(self.host, self.ports)
        binary = find_tritonserver(self.tritonserver)
        bundled = _bundled_root() if _is_bundled(binary) else None
        if bundled is not None:
            _check_stub_numpy(Path(sys.executable).parent)
        self._launch(self._command(binary, bundled), self._environment(bundled))
        endpoints = endpoints_at(_client_host(self.host), self.ports)
        try:
            self._wait_ready(endpoints, timeout)
        except ServeError as e:
            self.stop(drain_timeout=0)
            raise ServeError(f"{e}\n--- last lines of {self.log_path} ---\n{_tail(self.log_path)}") from None
        except BaseException:
            self.stop(drain_timeout=0)  # Ctrl-C while the models load must not leave the server behind
            raise
        self.endpoints = endpoints
        return endpoints

    def stop(self, drain_timeout: float | None = None) -> int:
        """Stop the server, its stubs and what they started, remove its shared memory, and
        return tritonserver's exit code: 0 when it shut down cleanly.

        The drain is the dflash model's (see the module's docstring): SIGTERM to the stubs of
        DRAIN_MODELS makes them refuse new requests and, once the last one in flight has
        ended, send SIGTERM to tritonserver. A second SIGTERM, after `drain_timeout` (default:
        the server's), fails what is left. Without such a stub tritonserver gets SIGTERM at
        once. Its exit timeout (EXIT_GRACE_S), then SIGKILL, bound the rest.
        """
        if self._proc is None:
            raise ServeError("this TritonServer was never started")
        drain = self.drain_timeout if drain_timeout is None else drain_timeout
        if self._exit_code() is None:
            if self._signal_drainers() and not self._wait_exit(drain):
                self._signal_drainers()
                self._wait_exit(1.0)  # they fail what is left, then stop tritonserver themselves
            if self._exit_code() is None:
                os.kill(self._proc.pid, signal.SIGTERM)  # tritonserver ignores it if it has one already
                self._wait_exit(EXIT_GRACE_S + 2)  # Triton counts its exit timeout in whole seconds
        return self._reap()

    def _signal_drainers(self) -> bool:
        drainers = [pid for pid, model in self.stubs().items() if model in DRAIN_MODELS]
        for pid in drainers:
            _signal(pid, signal.SIGTERM)
        return bool(drainers)

    def stubs(self) -> dict[int, str]:
        """pid -> model name of the Python backend stubs running now."""
        found = {}
        for pid in _group_members(self._proc.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # it just exited
            if Path(os.fsdecode(argv[0])).name == STUB and len(argv) > 1:
                found[pid] = Path(os.fsdecode(argv[1])).parent.parent.name  # <model>/<version>/model.py
        return found

    def watch(self, poll_s: float = 0.25) -> str:
        """Block until tritonserver or one of the stubs running now exits; say which.

        Polled from /proc: the stubs are tritonserver's children, not ours."""
        if self._proc is None:
            raise ServeError("this TritonServer was never started")
        stubs = self.stubs()
        while True:
            status = _exit_status(self._proc.pid)
            if status is not None:
                return f"tritonserver exited with code {status}"
            alive = _group_members(self._proc.pid)
            for pid, model in stubs.items():
                if pid not in alive:
                    return f"the Python backend stub of model '{model}' (pid {pid}) exited"
            time.sleep(poll_s)

    def wait(self) -> int:
        """Block until the server exits on its own or by a signal; return its exit code."""
        if self._proc is None:
            raise ServeError("this TritonServer was never started")
        try:
            # WNOWAIT: the exited server stays a zombie, so its pid (our process group id)
            # cannot be reused before _reap kills what is left of the group.
            os.waitid(os.P_PID, self._proc.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass  # a signal handler already called stop(), which reaped it
        return self._reap()

    def __enter__(self) -> TritonServer:
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self.stop()

    def _command(self, binary: Path, bundled: Path | None) -> list[str]:
        http, grpc, metrics = self.ports
        command = [
            str(binary), f"--model-repository={self.repository}",
            f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}",
            f"--http-address={self.host}", f"--grpc-address={self.host}", f"--metrics-address={self.host}",
            "--log-verbose=0", "--exit-on-error=true", "--strict-readiness=true",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--exit-timeout-secs={EXIT_GRACE_S}",
        ]
        if self.admin_key is not None:
            # Visible to local users in the process list; it keeps the admin APIs from the network.
            restriction = f"{ADMIN_APIS}:{ADMIN_HEADER}={self.admin_key}"
            command += [f"--http-restricted-api={restriction}", f"--grpc-restricted-protocol={restriction}"]
        if bundled is not None:
            # Another tritonserver (an NGC container's) keeps its own default backends.
            command += [f"--backend-directory={_prepare_backend_dir(bundled)}",
                        f"--cache-directory={bundled / 'caches'}"]
        return command + list(self.extra_args)

    def _environment(self, bundled: Path | None) -> dict[str, str]:
        env = {**os.environ, **self.env}
        bindir = Path(sys.executable).parent
        if not (bindir / "python3").exists():
            raise ServeError(f"{bindir} has no python3, which the Triton Python backend stub looks up on PATH")
        env["PATH"] = os.pathsep.join(filter(None, [str(bindir), env.get("PATH")]))
        libs = [_libpython_dir()] if bundled is not None else []  # first: it holds libpython only
        libs.append(env.get("LD_LIBRARY_PATH"))
        if bundled is not None:
            # The binaries find these through RPATH $ORIGIN, which a symlinked copy may not
            # resolve; pytriton adds them the same way.
            libs += [str(d) for d in (bundled.parent.parent / "nvidia_pytriton.libs", bundled / "external_libs")
                     if d.is_dir()]
        if any(libs):
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, libs))
        return env

    def _launch(self, command: list[str], env: dict[str, str]) -> None:
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="dflash-trt-tritonserver-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
        pr_set_pdeathsig = 1
        try:
            with open(self.log_path, "wb") as log:
                self._proc = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True, preexec_fn=lambda: prctl(pr_set_pdeathsig, signal.SIGTERM),
                )
        except OSError as e:
            raise ServeError(f"cannot run {command[0]}: {e}") from None

    def _exit_code(self) -> int | None:
        return self._proc.returncode if self._proc.returncode is not None else _exit_status(self._proc.pid)

    def _wait_exit(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._exit_code() is None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def _wait_ready(self, endpoints: Endpoints, timeout: float) -> None:
        # Triton starts the metrics service after HTTP and exits if that fails (a busy
        # port), so a ready HTTP endpoint alone does not mean the server will stay up.
        urls = [f"{endpoints.http}/v2/health/ready"]
        if "--allow-metrics=false" not in self.extra_args:
            urls.append(endpoints.metrics)
        deadline = time.monotonic() + timeout
        while True:
            status = _exit_status(self._proc.pid)
            if status is not None:
                raise ServeError(f"tritonserver exited with code {status} before it was ready")
            if all(_http_ok(url) for url in urls):
                return
            if time.monotonic() > deadline:
                raise ServeError(f"tritonserver was not ready after {timeout:.0f} s")
            time.sleep(0.1)

    def _reap(self) -> int:
        if self._proc.returncode is not None:
            return self._proc.returncode  # reaped: the pid may belong to someone else now
        # Stubs a crashed or killed server left behind are still in its process group.
        _signal_group(self._proc.pid, signal.SIGKILL)
        code = self._proc.wait()
        deadline = time.monotonic() + 5.0
        while _group_members(self._proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        # A clean shutdown removes the regions; a killed stub or server leaves its own.
        for region in SHM_DIR.glob(f"{self.shm_prefix}*"):
            region.unlink(missing_ok=True)
        return code


def _exit_status(pid: int) -> int | None:
    """The exit code (negative signal number) of our exited child, without reaping it."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None or info.si_pid == 0:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass  # it exited meanwhile


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
            if int(fields[2]) == pgid and fields[0] not in "ZX":
                members.append(int(entry.name))
    return members


def write_admin_key() -> tuple[str, Path]:
    """A new random admin key, and a file that only this user can read holding it."""
    key = secrets.token_urlsafe(24)
    fd, name = tempfile.mkstemp(prefix="dflash-trt-admin-key-")  # mode 0600
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key, Path(name)


def _bundled_root() -> Path | None:
    # find_spec locates the package without importing it (pytriton's import is slow).
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "tritonserver"


def _is_bundled(binary: Path) -> bool:
    root = _bundled_root()
    return root is not None and binary.resolve() == (root / "bin" / "tritonserver").resolve()


def _prepare_backend_dir(root: Path) -> Path:
    """A private --backend-directory whose python/ holds the stub built for this Python."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / STUB
    if not stub.is_file():
        have = sorted(p.name for p in (root / "python_backend_stubs").glob("*"))
        raise ServeError(f"nvidia-pytriton has no Python backend stub for Python {version} (it has {have})")
    # Keyed by the wheel's location, so two venvs never re-point each other's links.
    key = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:10]
    backends = cache_dir() / "triton-backends" / f"py{version}-{key}"
    links = {p.name: p for p in (root / "backends" / "python").iterdir() if p.name != "__pycache__"}
    links[STUB] = stub
    try:
        (backends / "python").mkdir(parents=True, exist_ok=True)
        for name, target in links.items():
            _symlink(backends / "python" / name, target)
    except OSError as e:
        raise ServeError(f"cannot prepare the Triton backend directory {backends}: {e}") from None
    return backends


def _symlink(link: Path, target: Path) -> None:
    if link.is_symlink() and os.readlink(link) == str(target):
        return
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)  # atomic: a server starting concurrently never sees a missing stub


def _libpython_dir() -> str | None:
    """A directory holding only this interpreter's libpython, to put first on LD_LIBRARY_PATH."""
    name, libdir = sysconfig.get_config_var("INSTSONAME"), sysconfig.get_config_var("LIBDIR")
    if not name or not libdir or not (Path(libdir) / name).is_file():
        return None  # a static Python: the stub falls back to the system's libpython
    # LIBDIR itself may be /usr/lib/<arch>; putting all of it first could shadow the CUDA
    # libraries a user put on LD_LIBRARY_PATH.
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    private = cache_dir() / "libpython" / f"{version}-{hashlib.sha1(libdir.encode()).hexdigest()[:10]}"
    try:
        private.mkdir(parents=True, exist_ok=True)
        _symlink(private / name, Path(libdir) / name)
    except OSError as e:
        raise ServeError(f"cannot prepare {private}: {e}") from None
    return str(private)


def _check_stub_numpy(bindir: Path) -> None:
    """The stub's numpy is the one `bindir/python3` imports in isolated mode, as the stub runs
    it: a numpy < 2 that only PYTHONPATH provides does not count (the stub never sees it)."""
    probe = "import numpy; print(numpy.__version__); print(numpy.__file__)"
    try:
        result = subprocess.run([str(bindir / "python3"), "-I", "-c", probe], capture_output=True, text=True)
    except OSError as e:
        raise ServeError(f"{bindir} has no runnable python3, which the Triton Python backend stub looks up on "
                         f"PATH: {e}") from None
    if result.returncode != 0:
        raise ServeError(f"the Triton Python backend needs numpy<2 importable by {bindir / 'python3'} "
                         f"without PYTHONPATH (the stub ignores it): pip install 'numpy<2'")
    version, where = result.stdout.split("\n")[:2]
    if int(version.split(".")[0]) >= 2:
        raise ServeError(
            f"the Python backend of the bundled Triton 2.51 does not work with numpy {version} "
            f"(tensors come back empty or garbled), and its stub imports {where}, PYTHONPATH ignored; "
            f"install numpy<2 in the environment of {bindir / 'python3'}: pip install 'numpy<2'"
        )


def _http_ok(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via http_proxy
    try:
        with opener.open(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False  # not listening yet, or 400 while the models load


def endpoints_at(host: str, ports) -> Endpoints:
    host = f"[{host}]" if ":" in host else host
    http, grpc, metrics = ports
    return Endpoints(f"http://{host}:{http}", f"{host}:{grpc}", f"http://{host}:{metrics}/metrics")


def _client_host(host: str) -> str:
    """Where a local client connects for a bind address (0.0.0.0 is not connectable)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace").replace("\0", "")
    except OSError as e:
        return f"(cannot read the log: {e})"
    return "\n".join(_drop_option_table(text.splitlines())[-lines:])


def _drop_option_table(lines: list[str]) -> list[str]:
    # Triton prints its ~20-line option table after the model status table: it would push
    # the models' load errors out of the tail.
    kept, skipping = [], False
    for line in lines:
        if line.startswith("| Option "):
            skipping = True
            if kept and kept[-1].startswith("+"):
                kept.pop()
        elif skipping and not line.startswith(("|", "+")):
            skipping = False
        if not skipping:
            kept.append(line)
    return kept
