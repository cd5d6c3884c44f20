from rlfabric.cli import main

# NOTE: guarded: engines that spawn processes (vLLM) re-import __main__ in the child
if __name__ == "__main__":
    raise SystemExit(main())
