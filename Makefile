# The two commands the README leads with. Each sets itself up (venv + install) on a fresh clone.
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/interlock demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
