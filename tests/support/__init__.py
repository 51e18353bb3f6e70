"""Programs the tests run as subprocesses."""

from pathlib import Path

KEYQ_WITH_SEAMS = Path(__file__).with_name("keyq_with_seams.py")
