"""``python -m bench``: see ``bench/ab.py`` for the command line."""

from bench.ab import main

if __name__ == "__main__":
    raise SystemExit(main())
