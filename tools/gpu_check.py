"""Prove the GPU paths in one call on a machine lent with a GPU (``make gpu-check``).

That machine has no network, Python 3.12 and its own torch (2.11 + CUDA), but none of lmdb, blake3 or
zstandard: ``make gpu-wheels`` downloads them here, for its Python, into ``build/gpu-wheels`` (carry
that folder). This script then, within ``--budget`` seconds in all:

1. installs those wheels into a private folder (``--no-index``: nothing is fetched) and runs with
   the checkout on ``PYTHONPATH`` (``import paramstore`` works from a plain checkout);
2. commits a model of CUDA tensors, checks it out with ``device="cuda"`` into a CUDA model and
   compares every tensor bit for bit (``OUT/gpu-check.json``);
3. runs every ``gpu``-marked test (``pytest -m gpu``), its report in ``OUT/gpu-tests.xml``;
4. runs the GPU rows of ``tools/bench_device.py`` (``OUT/bench_device.md`` and ``.json``, written
   after every row);
5. with the time left (about 2 minutes), the collective checkout at 7 receivers and 1 GiB on that
   machine's cores, with the time of each part, as shipped and with verification off
   (``tools/bench_broadcast.py --phases [--no-verify]``, ``OUT/broadcast7.log``): what the
   2-core CPU hosts cannot show.

Each step's output streams to ``OUT/<step>.log`` and the report is rewritten after every step, so
a run stopped at the device's limit still brings back what it did.

``OUT`` is ``$OUT`` (the device tool's folder that comes back) or ``build/gpu-check``. Without a
CUDA device it says so and exits 0. Exit 1 when a step failed.

    make gpu-wheels                              # here, with the network
    # device tool: run("make gpu-check", carry=["build/gpu-wheels"])
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS = os.path.join(REPO, "build", "gpu-wheels")
#: Test files holding gpu-marked tests (collected alone: the others need the CPU machine's extras).
GPU_TESTS = ["tests/test_device.py", "tests/test_pinning.py", "tests/test_collective.py",
             "tests/test_silent_failures.py", "tests/test_tier_contract.py"]


def cuda_devices() -> int:
    """How many CUDA devices this process sees (0 without torch's CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def install(site: str) -> str:
    """Install the carried wheels into ``site`` (none fetched); returns what pip said."""
    wheels = sorted(glob.glob(os.path.join(WHEELS, "*.whl")))
    if not wheels:
        return "no wheels carried (build/gpu-wheels is empty): using what this Python has"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                          "--target", site, *wheels], capture_output=True, text=True)
    return (out.stdout + out.stderr).strip() or f"installed {len(wheels)} wheels"


def step(name: str, argv: list[str], env: dict[str, str], timeout: float, log: str) -> dict:
    """Run one step as a child process, its output streamed to ``log`` (so a step stopped at its
    limit still leaves what it printed); its result (exit code, seconds, the output's tail)."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        # a session of its own: at the limit its whole process group goes (a bench's members too)
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
            f.write(f"\ntimed out after {timeout:.0f} s\n")
    with open(log) as f:
        text = f.read()
    print(f"== {name}: exit {rc} in {time.monotonic() - t0:.1f} s", flush=True)
    return {"name": name, "rc": rc, "seconds": round(time.monotonic() - t0, 1), "tail": text[-4000:]}


def environment() -> dict:
    """What the machine is: the GPU, the driver, torch, the room in /dev/shm."""
    import torch

    shm = os.statvfs("/dev/shm")
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0),
            "nvidia_smi": smi.stdout.strip(), "cpus": os.cpu_count(),
            "dev_shm_free_gib": round(shm.f_bavail * shm.f_frsize / (1 << 30), 1)}


def model_roundtrip() -> dict:
    """Commit CUDA tensors, check them out with ``device="cuda"`` into a CUDA model, compare bits."""
    import torch

    import paramstore

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda().to(torch.bfloat16)
    twin = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda().to(torch.bfloat16)
    root = tempfile.mkdtemp(prefix="gpu-check-", dir="/dev/shm")
    with paramstore.ParamStore(os.path.join(root, "s")) as store:
        t0 = time.perf_counter()
        store.commit(1, model).result(timeout=120)
        committed = time.perf_counter() - t0
        t0 = time.perf_counter()
        with store.checkout(1, device="cuda") as snap:
            snap.load_into(twin)
            torch.cuda.synchronize()
        loaded = time.perf_counter() - t0
    same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(model.state_dict().values(), twin.state_dict().values()))
    return {"bit_identical": same, "commit_s": round(committed, 4), "checkout_load_s": round(loaded, 4),
            "bytes": sum(t.nbytes for t in model.state_dict().values())}


def _write_json(path: str, data: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=2)
    os.replace(path + ".tmp", path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for everything (default 8 minutes)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "build", "gpu-check"))
    ap.add_argument("--roundtrip", action="store_true", help=argparse.SUPPRESS)  # step 2, in a child
    a = ap.parse_args()
    if a.roundtrip:
        print(json.dumps(model_roundtrip()))
        return 0
    os.makedirs(a.out, exist_ok=True)
    save = lambda report: _write_json(os.path.join(a.out, "gpu-check.json"), report)  # noqa: E731
    devices = cuda_devices()
    if not devices:
        print("gpu-check: no CUDA device here: nothing to check (run it on the machine the device tool lends)")
        return 0
    deadline = time.monotonic() + a.budget
    site = tempfile.mkdtemp(prefix="gpu-check-site-")
    report: dict = {"devices": devices, "python": sys.version.split()[0], "environment": environment(),
                    "install": install(site), "steps": []}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, REPO]), "MC_FORCE_TCP": "1", "PYTHONUNBUFFERED": "1"}
    left = lambda: deadline - time.monotonic()  # noqa: E731
    # The shortest and most telling first: a GPU model's round trip, then the tests, then the bench.
    roundtrip = step("model roundtrip", [sys.executable, "tools/gpu_check.py", "--roundtrip"], env,
                     min(120.0, left()), f"{a.out}/roundtrip.log")
    report["steps"].append(roundtrip)
    try:
        report["roundtrip"] = json.loads(roundtrip["tail"].strip().splitlines()[-1])
    except (ValueError, IndexError):
        report["roundtrip"] = None
    save(report)
    report["steps"].append(step("gpu tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                              "-o", "addopts=", "-m", "gpu", "-rfEs", f"--junitxml={a.out}/gpu-tests.xml",
                                              *GPU_TESTS], env, left() * 0.35, f"{a.out}/gpu-tests.log"))
    save(report)
    report["steps"].append(step("bench_device", [sys.executable, "tools/bench_device.py", "--rounds", "3",
                                                 "--json", f"{a.out}/bench_device.json",
                                                 "--markdown", f"{a.out}/bench_device.md"], env, left() - 5,
                                f"{a.out}/bench_device.log"))
    if left() > 120:
        common = "tools/bench_broadcast.py --mib 1024 --receivers 7 --bucket-mib 64 --rounds 3 --phases"
        script = f"{sys.executable} {common} && {sys.executable} {common} --no-verify"
        report["steps"].append({**step("broadcast, 7 receivers", ["bash", "-c", script], env, left() - 5,
                                       f"{a.out}/broadcast7.log"), "optional": True})
        save(report)
    # (the optional step, run with whatever time was left, may time out without failing the check)
    ok = all(s["rc"] == 0 for s in report["steps"] if not s.get("optional")) and bool(report["roundtrip"]) \
        and report["roundtrip"]["bit_identical"]
    report["ok"] = ok
    save(report)
    print(f"gpu-check: {'ok' if ok else 'FAILED'}; report in {a.out}/gpu-check.json")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
