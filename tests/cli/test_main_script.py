"""scripts/main.sh installs once, then skips the install until pyproject.toml or
scripts/setup-env.sh change (or .venv is new), saying so in one line; run here with a
stand-in setup-env.sh that records each install and a stand-in `glassformer`."""

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAKE_SETUP = """#!/usr/bin/env bash
set -euo pipefail
mkdir -p .venv/bin
printf '#!/usr/bin/env bash\\necho "$*"\\n' > .venv/bin/glassformer
chmod +x .venv/bin/glassformer
echo installed >> installs.log
"""


def _main(repo: Path) -> subprocess.CompletedProcess:
    run = subprocess.run(["bash", "scripts/main.sh", "--seed", "1"], cwd=repo, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("generate --model smollm2-135m-instruct") and "--seed 1" in run.stdout
    return run


def _installs(repo: Path) -> int:
    log = repo / "installs.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_main_installs_only_when_its_inputs_changed(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "main.sh", repo / "scripts" / "main.sh")
    shutil.copy(ROOT / "pyproject.toml", repo / "pyproject.toml")
    (repo / "scripts" / "setup-env.sh").write_text(FAKE_SETUP)
    _main(repo)
    assert _installs(repo) == 1
    skipped = _main(repo)
    assert _installs(repo) == 1
    assert len(skipped.stderr.splitlines()) == 1 and "not installing again" in skipped.stderr
    with open(repo / "pyproject.toml", "a") as f:
        f.write("\n# changed\n")
    _main(repo)
    assert _installs(repo) == 2
    _main(repo)
    assert _installs(repo) == 2
    shutil.rmtree(repo / ".venv")  # a new environment: installed again
    _main(repo)
    assert _installs(repo) == 3
