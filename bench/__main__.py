"""``python -m bench``: see ``bench/ab.py`` for the command line;
``python -m bench --serve``: the server load benchmark, ``bench/serve.py``;
``python -m bench --cold-start``: a fresh process's time to its first token, ``bench/cold_start.py``;
``python -m bench --spec``: speculative decoding with the MTP head, ``bench/spec.py``."""

import sys

if __name__ == "__main__":
    if "--spec" in sys.argv[1:]:
        from bench.spec import main as spec_main

        raise SystemExit(spec_main([a for a in sys.argv[1:] if a != "--spec"]))
    if "--cold-start" in sys.argv[1:]:
        from bench.cold_start import main as cold_start_main

        raise SystemExit(cold_start_main([a for a in sys.argv[1:] if a != "--cold-start"]))
    if "--serve" in sys.argv[1:]:
        from bench.serve import main as serve_main

        raise SystemExit(serve_main([a for a in sys.argv[1:] if a != "--serve"]))
    from bench.ab import main

    raise SystemExit(main())
