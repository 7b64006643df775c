"""``python -m plfl``: the ``plfl`` script, for an interpreter that has plfl importable but not installed."""

from plfl.cli import main

raise SystemExit(main())
