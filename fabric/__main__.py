from rlfabric.cli import main

raise SystemExit(main())
