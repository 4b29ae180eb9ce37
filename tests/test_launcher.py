"""tests/launcher.py retries a launch once for the known rank abort, and for nothing else."""
import pytest
from launcher import ABORT, launch_ranks

pytestmark = pytest.mark.multiproc

SCRIPT = """
import os, sys
marker = os.path.join(os.getcwd(), "attempted")
if os.environ.get("LOCAL_RANK") == "0" and not os.path.exists(marker):
    open(marker, "w").close()
    print({message!r}, file=sys.stderr, flush=True)
    {fail}
"""


def _script(tmp_path, message, fail):
    path = tmp_path / "rank.py"
    path.write_text(SCRIPT.format(message=message, fail=fail))
    return path


def test_the_known_abort_is_launched_again(tmp_path):
    proc, log = launch_ranks([_script(tmp_path, ABORT, "os.abort()")], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, log
    assert log.count("--num_gpus 2") == 2, log


@pytest.mark.parametrize("message, fail", [("some other error", "os.abort()"), (ABORT, "sys.exit(3)")])
def test_other_failures_are_not_retried(tmp_path, message, fail):
    """Another message, or the message with another exit: the first failure stands."""
    proc, log = launch_ranks([_script(tmp_path, message, fail)], cwd=tmp_path, timeout=120)
    assert proc.returncode != 0, log
    assert log.count("--num_gpus 2") == 1, log
