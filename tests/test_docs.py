"""Every snippet of docs/writing_a_pass.md runs, and the examples run."""

from __future__ import annotations

import importlib
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _tutorial_module(tmp_path: pathlib.Path):
    text = (ROOT / "docs" / "writing_a_pass.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 6
    (tmp_path / "writing_a_pass_tutorial.py").write_text("\n\n".join(blocks))
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module("writing_a_pass_tutorial")
    finally:
        pass


@pytest.mark.multirank
def test_writing_a_pass_tutorial(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    tutorial = _tutorial_module(tmp_path)
    try:
        assert tutorial.pipeline_order() == ["comm_fusion_with_concat", "bf16_compress", "schedule_comm_wait"]
        tutorial.check_direct_calls()
        tutorial.check_on_one_process()
        worst = tutorial.check_on_two_ranks()
        assert len(worst) == 2 and all(0 < w < 1e-2 for w in worst), worst
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("writing_a_pass_tutorial", None)


def _run_with_stacks_on_hang(cmd: list[str], env: dict[str, str], limit_s: float) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; past ``limit_s`` kill the whole session (torchrun and its
    ranks) and fail with the tail of its output, where every process wrote its threads' stacks
    a minute before (tests/stack_dump/sitecustomize.py)."""
    dump = str(ROOT / "tests" / "stack_dump")
    env = {**env, "SPMD_TEST_STACKS_AFTER_S": str(max(1.0, limit_s - 60)),
           "PYTHONPATH": os.pathsep.join([dump, env.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{cmd[2:]} ran past {limit_s:.0f}s; its output's tail, with every "
                    f"process's stacks:\n{out[-3000:]}\n{err[-30000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.multirank
@pytest.mark.slow
def test_transformer_example_runs_under_torchrun():
    torchrun = pathlib.Path(sys.executable).parent / "torchrun"
    result = _run_with_stacks_on_hang(
        [str(torchrun), "--standalone", "--nproc_per_node", "2",
         str(ROOT / "examples" / "train_transformer.py"), "--steps", "6", "--layers", "1",
         "--no-pictures"],
        # Inductor compiles before the first steady step (the suite's default): `make demo`
        # compiles in the background, which tests/test_background_compile.py covers; here it
        # cost 69 s on a cold cache against 39 s blocking
        {**os.environ, "SPMD_BACKEND_BACKGROUND_COMPILE": "0"},
        limit_s=480,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "largest parameter difference vs DDP" in result.stdout
    assert "Inductor's code from step" in result.stdout, result.stdout[-2000:]
