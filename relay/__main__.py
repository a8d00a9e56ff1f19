from relay.cli.main import main

raise SystemExit(main())
