import sys

from baton.kernels import main

sys.exit(main())
