"""The one thing pyproject.toml cannot say: the package list, found automatically.

Every `freetx/**/__init__.py` package is found by `find_packages`, so a new
subpackage is never left out of the wheel (tests/recipes/test_wheel.py checks).
The built-in recipes and configs live at the top of the repository and travel
as `freetx.recipes` and `freetx.recipe_configs` (see package-dir in pyproject).
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["freetx", "freetx.*"])
    + ["freetx.recipes", "freetx.recipe_configs"]
)
