"""``python -m dartree_ext ...`` is ``dartree-generate ...``."""
from .cli import generate_main

raise SystemExit(generate_main())
