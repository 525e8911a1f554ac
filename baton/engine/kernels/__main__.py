import sys

from baton.engine.kernels import main

sys.exit(main())
