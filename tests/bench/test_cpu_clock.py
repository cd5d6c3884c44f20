"""The benches' CPU figures: another process's CPU time, and its main thread's, exact (not in
/proc's 10 ms clock ticks), and NaN once it is gone."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from rlfabric.bench._util import cpu_seconds

SPIN = """
import sys, threading, time
def spin(s):
    t = time.thread_time()
    while time.thread_time() - t < s:
        pass
side = threading.Thread(target=spin, args=(0.05,))
side.start(); side.join()
spin(0.137)
print(time.process_time(), time.thread_time(), flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(sys.platform != "linux", reason="process CPU clocks and /proc: Linux")
def test_a_process_and_its_main_thread_are_counted_to_the_clock_not_the_tick() -> None:
    with subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            process, main = map(float, proc.stdout.readline().split())
            # read after the child read its own clocks: no less, and only what it did since
            assert process <= cpu_seconds([proc.pid]) < process + 0.005
            assert main <= cpu_seconds([proc.pid], thread=True) < main + 0.005
            assert process - main >= 0.045  # the side thread counts for the process only
        finally:
            proc.stdin.close()
            proc.wait(timeout=10)
    assert math.isnan(cpu_seconds([proc.pid])) and math.isnan(
        cpu_seconds([proc.pid], thread=True))
