import sys

from heteroflow_agent.main import main

sys.exit(main())
