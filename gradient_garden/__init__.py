"""A notebook-first, literate research platform for training language models

Modules:

- `gradient_garden.config`: One nested, typed `GlobalConfig` for every run; recipes that bundle it with a data mix; dotted overrides; and errors that name the key path, the value and what is allowed."""

__version__ = "0.1.0"
