"""`python -m ermedrag …` is the `ermedrag` command (e.g. under `accelerate launch -m ermedrag train …`)."""

from ermedrag.cli import run

run()
