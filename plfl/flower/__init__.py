"""plfl methods as Flower apps (``pip install -e '.[flower]'``): the server runs plfl's federation loop, each
SuperNode its own clients' hooks and tasks on its own data (:mod:`plfl.flower.app`)."""
