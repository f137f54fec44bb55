import sys

from echo.entrypoints.cli import main

sys.exit(main())
