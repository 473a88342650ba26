from loraserve.cli import main

raise SystemExit(main())
