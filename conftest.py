"""Settings every test directory shares.

Property tests keep every counterexample they ever found: hypothesis saves a failing example in a committed example
database (`tests/hypothesis-examples`, commit what a failure adds there) and replays it first on every run, and it
prints the reproduction blob of any failure, so a failure found once is checked on every run after it."""

from pathlib import Path

from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase

settings.register_profile(
    "gyre",
    database=DirectoryBasedExampleDatabase(Path(__file__).parent / "tests" / "hypothesis-examples"),
    print_blob=True,
)
settings.load_profile("gyre")
