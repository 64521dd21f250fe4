"""A launcher that stops collecting its exited ranks is found and ended
(distbelief.runtime.launching.stuck_launcher), by the tests' run_mpi and by
slurm/one_node.sbatch."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from helpers.mpi_jobs import communicate, job_tree

from distbelief.runtime.launching import stuck_launcher

# A stand-in for a stuck prterun: it starts two "ranks" that end at once and never
# collects them (subprocess.Popen waits for a child only when asked), then sleeps.
STUCK = ("import subprocess, sys, time\n"
         "ranks = [subprocess.Popen([sys.executable, '-c', 'pass']) for _ in range(2)]\n"
         "print('started', flush=True)\n"
         "time.sleep(60)\n")
# A launcher whose rank still runs, and one that collects its ranks as they end.
BUSY = ("import subprocess, sys, time\n"
        "rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n")
COLLECTS = ("import subprocess, sys, time\n"
            "subprocess.run([sys.executable, '-c', 'pass'])\n"
            "print('started', flush=True)\n"
            "time.sleep(60)\n")


def _launch(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline() == "started\n"
    return proc


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        subprocess.run(["pkill", "-9", "-g", str(proc.pid)], check=False)
    proc.communicate(timeout=30)


def test_only_a_launcher_whose_children_all_exited_uncollected_counts_as_stuck() -> None:
    procs = {name: _launch(code) for name, code in
             (("stuck", STUCK), ("busy", BUSY), ("collects", COLLECTS))}
    try:
        deadline = time.monotonic() + 20  # the stand-in's ranks take a moment to end
        while (time.monotonic() < deadline
               and not stuck_launcher.all_children_exited(procs["stuck"].pid)):
            time.sleep(0.1)
        assert stuck_launcher.all_children_exited(procs["stuck"].pid)
        assert not stuck_launcher.all_children_exited(procs["busy"].pid)  # a rank runs
        assert not stuck_launcher.all_children_exited(procs["collects"].pid)  # no children
    finally:
        for proc in procs.values():
            _end(proc)


def test_watch_ends_a_stuck_launcher_after_its_grace_and_leaves_a_busy_one() -> None:
    stuck, busy = _launch(STUCK), _launch(BUSY)
    try:
        t0 = time.monotonic()
        assert stuck_launcher.watch(stuck.pid, grace=1.0)
        assert stuck.wait(timeout=10) == -9
        assert time.monotonic() - t0 < 15
        # The busy one outlives a watch of 3 s: run the watcher as the script does, and
        # see it still waiting.
        watcher = subprocess.Popen([sys.executable, "-m",
                                    "distbelief.runtime.launching.stuck_launcher",
                                    str(busy.pid), "1"], stderr=subprocess.PIPE, text=True)
        with pytest.raises(subprocess.TimeoutExpired):
            watcher.wait(timeout=3)
        assert busy.poll() is None
        _end(busy)
        assert watcher.wait(timeout=10) == 0  # it ends with the launcher, saying nothing
        assert watcher.stderr.read() == ""
    finally:
        _end(stuck)
        _end(busy)


def test_the_watcher_says_why_it_ends_a_launcher_and_refuses_bad_arguments() -> None:
    stuck = _launch(STUCK)
    try:
        done = subprocess.run([sys.executable, "-m", "distbelief.runtime.launching.stuck_launcher",
                               str(stuck.pid), "1"], capture_output=True, text=True, timeout=60,
                              check=False)
        assert done.returncode == 0
        assert f"the launcher (pid {stuck.pid}) has not collected its ranks" in done.stderr
        assert stuck.wait(timeout=10) == -9
    finally:
        _end(stuck)
    bad = subprocess.run([sys.executable, "-m", "distbelief.runtime.launching.stuck_launcher", "x"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "usage:" in bad.stderr


def test_run_mpis_wait_ends_a_stuck_launcher_with_a_warning() -> None:
    stuck = _launch(STUCK)
    try:
        t0 = time.monotonic()
        with pytest.warns(UserWarning, match="collected none of its exited ranks"):
            communicate(stuck, timeout=60, tree=job_tree(stuck.pid))
        assert stuck.returncode == -9
        assert time.monotonic() - t0 < 30
    finally:
        _end(stuck)


def test_the_grace_comes_from_the_environment_and_a_bad_value_is_said(monkeypatch,
                                                                      capsys) -> None:
    monkeypatch.delenv(stuck_launcher.GRACE_ENV, raising=False)
    assert stuck_launcher.grace_s() == stuck_launcher.GRACE_S
    monkeypatch.setenv(stuck_launcher.GRACE_ENV, "2.5")
    assert stuck_launcher.grace_s() == 2.5
    assert capsys.readouterr().err == ""
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv(stuck_launcher.GRACE_ENV, bad)
        assert stuck_launcher.grace_s() == stuck_launcher.GRACE_S
        assert f"{stuck_launcher.GRACE_ENV}={bad!r} is not a positive number" in \
            capsys.readouterr().err


def test_only_a_launcher_that_failed_with_pmix_listener_error_is_launched_again() -> None:
    from helpers.mpi_jobs import PMIX_LISTENER_FAILED, launcher_failed_to_start

    text = f"----\n{PMIX_LISTENER_FAILED}. We cannot\ncontinue.\n----\n"
    assert launcher_failed_to_start(213, text)
    assert not launcher_failed_to_start(0, text)  # it ran after all
    assert not launcher_failed_to_start(1, "distbelief: error: bad config\n")
