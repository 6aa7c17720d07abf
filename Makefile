# `make demo` runs the main job end to end on embedded defaults; `make test` runs the whole suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint compose-check clean

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

compose-check:
	docker-compose --env-file .env.example -f docker-compose.yml config -q

clean:
	rm -rf $(VENV) .convoq
