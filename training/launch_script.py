"""What ``./train_taehv_h100.sh`` runs (the script only picks the interpreter): the command
line, the pre-flight, the choice of launcher and Accelerate config, and the launch, with
SIGTERM/SIGINT passed on to training.

    ./train_taehv_h100.sh NUM_GPUS CONFIG_TYPE [custom CONFIG_PATH] [options] [--key=value ...]

A problem the user fixes is one line ``error: ...`` on stderr and exit status 2, before
anything starts. The pre-flight runs once per launch, here (``training.launch_check``); the
training processes get its notes instead of checking again. The launch then waits on
training and exits with its status (128 + N when the launcher died of signal N).

SIGTERM/SIGINT reach the training processes themselves: each finishes its step, they save a
checkpoint together and exit 0 (a signal during start-up stops them before the first step).
This process passes a signal it receives on to them, not to the launcher, which would kill
them. A scheduler that signals the whole job (scancel, preemption, ``kill -TERM -- -PGID``)
reaches the launcher too: it gives the training processes TORCH_ELASTIC_SHUTDOWN_TIMEOUT
seconds to save before it kills them, and ``training.launch`` then exits with training's own
status.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import multiprocessing
import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from taehv_train.base.errors import EXIT_USER_ERROR
from taehv_train.base.ports import free_port
from taehv_train.common.presets import CONFIGS_DIR
from taehv_train.training.launch_args import LaunchArgs, LaunchRefused, parse, usage
from taehv_train.training.launch_check import CHECKED_NOTES, PACKAGES, Check, checked

# set by train_taehv_h100.sh: where the user ran it (typed paths are relative to it) and the script itself
CALLER_DIR, SCRIPT = "TAEHV_CALLER_DIR", "TAEHV_LAUNCH_SCRIPT"
CPU_PRESETS = ("test", "demo", "scratch", "custom")  # the others are sized for GPUs


class Terminal:
    """The script's lines: ``[ok]`` and ``[warn]`` on stdout, ``error:`` on stderr, in colour on a terminal."""

    def __init__(self) -> None:
        colour = sys.stdout.isatty()
        self.green, self.yellow, self.bold, self.reset = (
            ("\033[32m", "\033[33m", "\033[1m", "\033[0m") if colour else ("", "", "", "")
        )

    def ok(self, text: str) -> None:
        print(f"{self.green}[ok]{self.reset} {text}", flush=True)

    def warn(self, text: str) -> None:
        print(f"{self.yellow}[warn]{self.reset} {text}", flush=True)

    def die(self, text: str, status: int = EXIT_USER_ERROR) -> None:
        label = "\033[31merror:\033[0m" if sys.stderr.isatty() else "error:"
        print(f"{label} {text}", file=sys.stderr, flush=True)
        sys.exit(status)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    sys.stdout.reconfigure(line_buffering=True)  # each line in order with training's, also into a file
    out = Terminal()
    if not argv:
        print(usage(out.bold, out.reset))
        sys.exit(EXIT_USER_ERROR)
    if "--help" in argv or "-h" in argv:
        print(usage(out.bold, out.reset))
        sys.exit(0)
    python = os.environ.get("PYTHON") or sys.executable
    caller = Path(os.environ.get(CALLER_DIR) or os.getcwd())
    os.chdir(CONFIGS_DIR.parents[1])  # the repository, where the presets' paths and accelerate_configs/ lead
    try:
        args = parse(argv, caller)
    except LaunchRefused as err:
        out.die(str(err))
    if args.debug:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    if args.data:  # own videos: annotate (new files only), split, train on them with validation
        data = own_data(python, args)
        args.extra = [*data, *args.extra]
        out.ok(f"data: {args.data} ({' '.join(data)})")
    if any(importlib.util.find_spec(name) is None for name in PACKAGES):
        out.die(
            f"the Python environment ({python}) lacks this package or torch/accelerate/deepspeed/diffusers: "
            f"run 'make setup' (or 'pip install -e .' in {os.getcwd()})"
        )
    check = preflight(args)
    out.ok(f"python environment: {python}")
    nodes, node_rank = check_nodes(out, args, check.gpus)
    report_check(out, args, check)
    command = launch_command(out, python, args, check.gpus, nodes, node_rank)
    print(f"{out.bold}launch:{out.reset} {' '.join(command)}", flush=True)
    os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or "900"
    os.environ["TAEHV_LAUNCH_COMMAND"] = shlex.join([os.environ.get(SCRIPT, "./train_taehv_h100.sh"), *args.typed])
    os.environ[CHECKED_NOTES] = json.dumps(list(check.notes))
    sys.exit(run(out, command, signal_children=args.num_gpus > 1 or check.gpus > 0))


def own_data(python: str, args: LaunchArgs) -> list[str]:
    """``training.own_data`` on ``--data``'s folder: the overrides that train on it. Its
    refusals are one ``error: ...`` line and its exit status, as the pre-flight's."""
    with tempfile.TemporaryDirectory(prefix="taehv_data_") as folder:
        overrides = Path(folder) / "overrides"
        command = [python, "-m", "taehv_train.training.own_data", args.data, "--config", args.config]
        status = subprocess.run([*command, "--overrides_file", str(overrides), *args.extra]).returncode
        if status != 0:
            sys.exit(status)
        return overrides.read_text().splitlines()


def preflight(args: LaunchArgs) -> Check:
    """``training.launch_check.checked`` in a process of its own, which ends with it. Forked:
    this process has loaded neither torch nor CUDA, nor started a thread, and a forked child
    ends without the interpreter's teardown, which costs a spawned one about a second once
    torch is loaded (``base.process_exit`` says why)."""
    fork = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=fork) as pool:
        return pool.submit(checked, args.config, args.extra, processes_per_node(args.num_gpus)).result()


def node_count() -> int | None:
    """NNODES (1 when unset); None when it is no positive integer."""
    nodes = os.environ.get("NNODES") or "1"
    return int(nodes) if nodes.isdigit() and int(nodes) > 0 else None


def processes_per_node(num_gpus: int) -> int:
    """The training processes this node starts: NUM_GPUS shared by the nodes (all of them
    while NNODES is wrong, which ``check_nodes`` refuses)."""
    nodes = node_count()
    return num_gpus // nodes if nodes is not None and num_gpus % nodes == 0 else num_gpus


def check_nodes(out: Terminal, args: LaunchArgs, gpus: int) -> tuple[int, int]:
    """The number of nodes and this node's rank, checked against NUM_GPUS and the visible GPUs."""
    node_rank = os.environ.get("NODE_RANK") or os.environ.get("RANK") or ""
    if node_rank and not os.environ.get("NNODES"):
        out.die("NODE_RANK/RANK is set but NNODES is not: set NNODES (e.g. NNODES=2) so the nodes form one job")
    nodes = node_count()
    if nodes is None:
        out.die(f"NNODES must be a positive integer, got '{os.environ['NNODES']}'")
    if args.num_gpus % nodes:
        out.die(f"NUM_GPUS={args.num_gpus} is not divisible by NNODES={nodes}")
    per_node = args.num_gpus // nodes
    if gpus == 0:
        slow = "fine for test/demo, far too slow for real training"
        out.warn(f"no CUDA GPU: starting {args.num_gpus} CPU process(es) ({slow})")
        if args.config_type not in CPU_PRESETS:
            out.warn(f"{args.config_type} is sized for GPUs: on a CPU use scratch, demo or test")
        cores = len(os.sched_getaffinity(0))  # the cores this process may use
        if args.num_gpus > cores:
            out.warn(
                f"{args.num_gpus} processes on {cores} CPU core(s): they share the cores and every step waits for "
                f"the slowest; start at most {cores}"
            )
        if nodes != 1:
            out.die("multi-node runs need GPUs")
    elif per_node > gpus:
        out.die(
            f"asked for {per_node} GPU(s) on this node but only {gpus} are visible "
            f"(NUM_GPUS={args.num_gpus}, NNODES={nodes})"
        )
    else:
        out.ok(f"{gpus} GPU(s) visible, using {per_node} on this node ({nodes} node(s))")
    return nodes, int(node_rank or 0)


def report_check(out: Terminal, args: LaunchArgs, check: Check) -> None:
    """The pre-flight's output; a refusal (exit 2: the output on stdout, the error alone on
    stderr) or a crash (its traceback) ends the launch, and so does a finished run (exit 0)."""
    if check.error:
        print(check.output, end="", flush=True)
        print(check.error, file=sys.stderr, flush=True)
        sys.exit(EXIT_USER_ERROR)
    if check.crash:
        print(check.output + check.crash, end="", file=sys.stderr)
        print("the configuration check crashed (exit status 1; the traceback above): please report it", file=sys.stderr)
        sys.exit(1)
    print(check.output, end="", flush=True)
    if check.done:
        out.ok(check.done)
        sys.exit(0)
    if check.resume:
        out.ok(
            "config: the run's own, saved in its checkpoint, with the changes below "
            "(data, reference VAE, frame counts and resume checked)"
        )
        print(f"{out.bold}[resume]{out.reset} {check.resume}", flush=True)
    else:
        out.ok(f"config {args.config} (data, reference VAE, frame counts and resume checked)")


def launch_command(out: Terminal, python: str, args: LaunchArgs, gpus: int, nodes: int, node_rank: int) -> list[str]:
    """The command that starts training: the training process itself for one CPU process,
    else ``training.launch`` (``accelerate launch``) with DeepSpeed ZeRO-2: on CPU from flags,
    on GPUs from the Accelerate config for one GPU, one node or several nodes."""
    train = ["-m", "taehv_train.training.taehv_train", "--config", args.config, *args.extra]
    # one node: a free port unless MASTER_PORT names one (two jobs on a machine do not collide);
    # several nodes: the port every node was told, 29500 unless MASTER_PORT says otherwise
    port = os.environ.get("MASTER_PORT") or ("29500" if nodes > 1 else str(free_port()))
    launch = [python, "-m", "taehv_train.training.launch"]
    if gpus == 0 and args.num_gpus == 1:
        return [python, *train]
    if gpus == 0:
        return [*launch, "--use_deepspeed", "--zero_stage", "2", "--num_machines", "1",
                "--num_processes", str(args.num_gpus), "--main_process_port", port, *train]  # fmt: skip
    if nodes > 1:
        if not os.environ.get("MASTER_ADDR"):
            out.die("multi-node runs need MASTER_ADDR (the address of node 0)")
        return [*launch, "--config_file", accelerate_config(args.num_gpus, nodes),
                "--num_machines", str(nodes), "--num_processes", str(args.num_gpus), "--machine_rank", str(node_rank),
                "--main_process_ip", os.environ["MASTER_ADDR"], "--main_process_port", port, *train]  # fmt: skip
    return [*launch, "--config_file", accelerate_config(args.num_gpus, nodes),
            "--num_processes", str(args.num_gpus), "--main_process_port", port, *train]  # fmt: skip


def accelerate_config(num_gpus: int, nodes: int) -> str:
    """The Accelerate config of a GPU launch: for one GPU, one node or several nodes."""
    name = "deepspeed_16gpu" if nodes > 1 else "deepspeed_1gpu" if num_gpus == 1 else "deepspeed_8gpu"
    return f"accelerate_configs/{name}.yaml"


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (``pkill -P``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # ended meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def run(out: Terminal, command: list[str], signal_children: bool) -> int:
    """Start ``command`` and wait for it; SIGTERM and SIGINT go on to the training processes
    (the children of the launcher when ``signal_children``, else the one started); returns
    its exit status, 128 + N when it died of signal N, as a shell reports it."""
    keyboard = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's background job: Ctrl+C is ours to pass on
    quit_ = signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    child = subprocess.Popen(command)
    signal.signal(signal.SIGINT, keyboard)
    signal.signal(signal.SIGQUIT, quit_)

    def forward(signum: int, frame: object) -> None:
        out.warn(
            f"{signal.Signals(signum).name}: asking training to stop at the next step "
            "(it saves a checkpoint once training has started)"
        )
        for pid in children(child.pid) if signal_children else [child.pid]:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:  # it ended meanwhile: nothing left to stop
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status = child.wait()
    return 128 - status if status < 0 else status


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl+C before the launch: nothing started, ended as a shell reports it
        sys.exit(128 + signal.SIGINT)
