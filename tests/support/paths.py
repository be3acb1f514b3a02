"""Where the tests find the project and their data files, wherever a test module sits."""

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
TEST_DATA = PROJECT_ROOT / "tests" / "data"
