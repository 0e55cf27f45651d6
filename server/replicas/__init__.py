"""Data parallelism on Ray Serve: N engine replicas behind one OpenAI-compatible ingress,
with a request router that sends each prompt to the replica caching most of its prefix.

* `kv_events.py`: a replica's log of its prefix cache's block events (stored / removed),
  published to the router through Ray Serve's routing stats.
* `prefix_router.py`: the request router (Ray Serve's `RequestRouter` extension point).
* `remote_engine.py`: the ingress's engine client: the same interface the HTTP app uses
  for a local engine, over a Ray Serve deployment handle.
* `deployment.py`: the two deployments and the application builder that `serve run`
  and `pagedserve serve --data-parallel-size N` use.

Ray is imported only here: a single server never loads it.
"""
