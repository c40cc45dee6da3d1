"""slimtorch slim: every step chained toward a goal, and its report.

- :func:`slim` (:class:`SlimOptions`): from a model, task data and a goal (``size=0.05x``, ``latency=2x``,
  ``params=0.5``) to a smaller deliverable, verified on the data, with a :class:`SlimReport` and its files
  (``report.html``, charts, ``report.json``) in a resumable work folder.
- :func:`parse_goal` (:class:`Goal`), :func:`read_recipe` (:class:`Recipe`): the goal and ``recipe.toml``.
"""

from slimtorch.slimming.goal import Goal, parse_goal
from slimtorch.slimming.options import SlimOptions
from slimtorch.slimming.pipeline import slim
from slimtorch.slimming.recipe import Recipe, read_recipe
from slimtorch.slimming.report import SlimReport

__all__ = ["Goal", "Recipe", "SlimOptions", "SlimReport", "parse_goal", "read_recipe", "slim"]
