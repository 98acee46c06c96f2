"""Attack code the lessons run against minikv (import the submodule you need).

* :mod:`minikv.attacks.prefix_oracle` -- leak 1: the shared prefix cache as an oracle, through the
  cached-token count and through time to first token (lesson 04; re-run by 07, 08 and 09);
* leak 2, reading a previous request's K/V (lesson 05): :mod:`minikv.attacks.kv_inversion`
  (layer-0 K/V back to text) and :mod:`minikv.attacks.engine_bugs` (the deliberately buggy
  engine helpers that hand stale K/V to the wrong reader);
* :mod:`minikv.attacks.poisoning` -- leak 3: weak cache keys and crafted collisions (lesson 06);
* :mod:`minikv.attacks.collisions` -- the collision search against the unsafe hashers, and the
  committed pairs it found (``collision_pairs.json``; lessons 06 and 07).

Nothing is imported here, so that ``import minikv.attacks.prefix_oracle`` does not pull in the
others' dependencies.
"""
