import sys

from jaxmoe.cli import main

sys.exit(main())
