from narwhal.cli import main

raise SystemExit(main())
