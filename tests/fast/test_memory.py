"""tinytf.fast.cpu.memory: freed arrays are reused by the next step instead of page-faulting."""
import os
import platform
import subprocess
import sys

import pytest

from tinytf.fast.cpu import memory

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                           reason="mallopt's thresholds are glibc's")

# A step's pattern: ten 4 MB arrays written, then all freed; the page faults of the last
# five of seven steps, measured in a fresh process (the setting is process-wide).
FAULTS_PER_STEP = """
import resource, sys, numpy as np, tinytf
from tinytf.fast.cpu import memory
if sys.argv[1] == "command":
    import tinytf.commands
    tinytf.commands.start_process()     # what each command does when it starts

def step():
    arrays = [np.ones(1 << 20, np.float32) for _ in range(10)]
    del arrays

step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(memory.kept(), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


def _faults_per_step(how="command", **env):
    environ = {k: v for k, v in os.environ.items()
               if not memory.user_tuned_malloc({k: v})}
    out = subprocess.run([sys.executable, "-c", FAULTS_PER_STEP, how], env=dict(environ, **env),
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0] == "True", float(out[1])


@glibc
def test_a_command_keeps_freed_memory_for_the_next_step():
    kept, faults = _faults_per_step()
    assert kept
    assert faults < 100                  # reused: no fresh pages after the first steps
    kept, faults = _faults_per_step(TINYTF_KEEP_MEMORY="0")
    assert not kept
    assert faults > 2000                 # glibc's default: 40 MB trimmed and faulted again
    kept, faults = _faults_per_step("import")  # a library user's process: left as it is
    assert not kept
    assert faults > 2000


@glibc
def test_a_users_own_malloc_tuning_is_left_alone():
    kept, _ = _faults_per_step(MALLOC_ARENA_MAX="2")
    assert not kept
    kept, _ = _faults_per_step(GLIBC_TUNABLES="glibc.malloc.trim_threshold=1000000")
    assert not kept


def test_user_tuned_malloc_reads_the_environment():
    assert not memory.user_tuned_malloc({})
    assert not memory.user_tuned_malloc({"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX2"})
    assert memory.user_tuned_malloc({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"})
    assert memory.user_tuned_malloc({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert memory.user_tuned_malloc({"MALLOC_ARENA_MAX": "2"})
    assert not memory.user_tuned_malloc({"MALLOC": "x"})
