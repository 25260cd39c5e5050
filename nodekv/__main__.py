from nodekv.cli import main

raise SystemExit(main())
