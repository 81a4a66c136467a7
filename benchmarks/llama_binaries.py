"""llama.cpp's own binaries beside a benchmark: `llama-bench` for one-stream decode and
`llama-server` for many streams over HTTP. They are found in the folder that `--llama-cpp DIR`
or $LLAMA_CPP_DIR names (a build's `bin/` folder; ../shared/ANCHORS.md builds one from the
source on PyPI, without network). Without them a benchmark says so and leaves their rows out.

Files as users download them are made by llama.cpp's own tools: `convert_hf` (its
`convert_hf_to_gguf.py`, from the source folder above the build) and `quantize`
(`llama-quantize`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ENVIRONMENT = "LLAMA_CPP_DIR"
BINARIES = ("llama-bench", "llama-server")


def add_argument(parser) -> None:
    parser.add_argument("--llama-cpp", type=Path, default=os.environ.get(ENVIRONMENT) or None,
                        help=f"the folder holding llama.cpp's {' and '.join(BINARIES)} (default: "
                             f"${ENVIRONMENT}); without it their rows are left out")


def find(folder: Path | None, name: str) -> Path | None:
    """The binary `name` in `folder`, or None (with a line on stderr saying why)."""
    if folder is None:
        print(f"llama.cpp: no --llama-cpp folder or ${ENVIRONMENT}: its rows are left out", file=sys.stderr)
        return None
    path = Path(folder) / name
    if not os.access(path, os.X_OK):
        print(f"llama.cpp: {path} is not an executable file: its rows are left out", file=sys.stderr)
        return None
    return path


def source_folder(binaries: Path) -> Path | None:
    """llama.cpp's source folder (convert_hf_to_gguf.py and gguf-py/) above the build folder
    `binaries`, or None (with a line on stderr)."""
    for folder in Path(binaries).resolve().parents:
        if (folder / "convert_hf_to_gguf.py").is_file():
            return folder
    print(f"llama.cpp: no convert_hf_to_gguf.py above {binaries}: its rows are left out", file=sys.stderr)
    return None


def run(command: list[str], **env: str) -> str:
    """The command's stdout (env added to the environment); raises with its stderr's end where
    it fails."""
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ | env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:3])} ... failed:\n{done.stderr[-2000:]}")
    return done.stdout


def convert_hf(source: Path, folder: Path, out: Path, outtype: str) -> Path:
    """The Hugging Face folder written as the GGUF file `out` (outtype f32, f16, ...) by the
    converter of llama.cpp's source folder `source`."""
    run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
          "--outfile", str(out)], PYTHONPATH=str(source / "gguf-py"))
    return out


def quantize(binaries: Path, gguf: Path, out: Path, kind: str) -> Path:
    """`gguf` quantized to `kind` (Q4_K_M, Q8_0, ...) by the `llama-quantize` in `binaries`."""
    run([str(Path(binaries) / "llama-quantize"), str(gguf), str(out), kind])
    return out


def gguf_file(model: str) -> Path | None:
    """The GGUF file of a benchmark's --model (a known model's name or a path), or None (with a
    line on stderr) where it is not one."""
    from glassformer.formats import hub

    path = Path(model) if Path(model).exists() else hub.model_path(model)
    if path.suffix != ".gguf" or not path.is_file():
        print(f"llama.cpp: {path} is not a GGUF file: its rows are left out", file=sys.stderr)
        return None
    return path


def bench_decode(bench: Path, model: Path, threads: int, tokens: int, repeats: int) -> list[float]:
    """llama-bench's one-stream decode (its tg<tokens> test, no prompt): tokens/s of each of its
    `repeats` runs."""
    command = [str(bench), "-m", str(model), "-t", str(threads), "-p", "0", "-n", str(tokens),
               "-r", str(repeats), "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)
    if done.returncode:
        raise RuntimeError(f"llama-bench failed:\n{done.stderr[-2000:]}")
    tests = [t for t in json.loads(done.stdout) if t["n_gen"] == tokens and t["n_prompt"] == 0]
    return [float(v) for v in tests[0]["samples_ts"]]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LlamaServer:
    """`llama-server` with `slots` parallel sequences (continuous batching) on a free loopback
    port, each slot holding `context` tokens; its output in `log`."""

    def __init__(self, server: Path, model: Path, threads: int, slots: int, context: int,
                 log: Path) -> None:
        self.url, self.log = f"http://127.0.0.1:{free_port()}", log
        command = [str(server), "-m", str(model), "-t", str(threads), "-np", str(slots),
                   "-c", str(slots * context), "--host", "127.0.0.1", "--port", self.url.split(":")[-1]]
        with open(log, "w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> None:
        wait_healthy(self.url, self.process, self.log, timeout, "llama-server")


def wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float, name: str) -> None:
    """Until `url`/health answers 200; raises with the end of `log` if `process` exits first or
    `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            break
        time.sleep(0.5)
    raise RuntimeError(f"{name} did not start:\n{log.read_text()[-2000:]}")
