from spotpipe.cli.main import main

raise SystemExit(main())
