"""Print the README's two commands (the first two ```bash blocks under "## Quick start"), one a line,
so that CI runs exactly what a new user reads."""

import re
import sys
from pathlib import Path

text = Path(sys.argv[1]).read_text()
section = text.split("\n## Quick start", 1)[1].split("\n## ", 1)[0]
blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
commands = [" ".join(line.strip() for line in block.strip().splitlines()) for block in blocks[:2]]
if len(commands) != 2 or not all(commands):
    sys.exit("ci: README's Quick start must open with two ```bash blocks: the main job, then the tests")
print("\n".join(commands))
