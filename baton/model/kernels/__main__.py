import sys

from baton.model.kernels import main

sys.exit(main())
