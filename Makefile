# `make demo` runs the main job end to end on embedded defaults; `make test` runs the whole suite (the docs site's
# strict build among it); `make docs` serves the documentation site as you edit it.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint docs compose-check clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m cli.main demo

# three processes, a test file each at a time: most tests wait on real servers, so two cores keep up
test: $(STAMP)
	$(PY) -m pytest -q -n 3 --dist loadfile --durations=20

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# port 8001: the API's examples use 8000
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve -a 127.0.0.1:8001

compose-check:
	docker-compose --env-file .env.example -f docker-compose.yml config -q

clean:
	rm -rf $(VENV) .convoq site
