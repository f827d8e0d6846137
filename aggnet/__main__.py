from aggnet.cli.main import main

raise SystemExit(main())
