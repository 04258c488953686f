"""``python -m bench``: see ``bench/ab.py`` for the command line;
``python -m bench --serve``: the server load benchmark, ``bench/serve.py``."""

import sys

if __name__ == "__main__":
    if "--serve" in sys.argv[1:]:
        from bench.serve import main as serve_main

        raise SystemExit(serve_main([a for a in sys.argv[1:] if a != "--serve"]))
    from bench.ab import main

    raise SystemExit(main())
