"""Edge and multi-instance serving: many engines sharing one set of weights, behind a router.

Lesson 10 (``course/10_edge_and_multi_instance.ipynb``) uses these pieces to show what changes
when one engine becomes a fleet of short-lived instances: the router becomes a side channel,
churn throws the cache away, governance (keys, scrubbing, audit) must hold on every node, and
the eviction side channel survives per-tenant keys unless quotas partition the pool.

    from minikv import LLM
    from minikv.edge import EdgeFleet
    donor = LLM("tiny-random", num_blocks=4)              # loads the weights once
    fleet = EdgeFleet(donor, num_instances=3, router="prefix", enable_prefix_caching=True,
                      num_blocks=64, engine_secret=b"operator secret, 16+ bytes")
    resp = fleet.submit("Hello", tenant="alice")       # resp.instance, resp.num_cached_tokens
"""
from minikv.edge.fleet import EdgeFleet, merge_trails, prime_and_probe
from minikv.edge.instance import EdgeInstance, EdgeResponse, shared_weights_engine
from minikv.edge.router import PrefixAffinityRouter, RoundRobinRouter, bracket_verdict

__all__ = ["EdgeFleet", "EdgeInstance", "EdgeResponse", "PrefixAffinityRouter", "RoundRobinRouter",
           "bracket_verdict", "merge_trails", "prime_and_probe", "shared_weights_engine"]
