"""`tessera router`: a prefix- and load-aware HTTP proxy in front of one InferenceCluster's
group leaders (docs/router.md).

endpoints / kube_source: where the leaders are (EndpointSource); load: their queue and KV
usage, polled; prompt_hashes + prefix_index: which leader likely holds a prompt's KV blocks;
scorer: the choice; hold: requests that arrive while no leader is Ready; proxy: the
forwarding itself; app: the aiohttp server that joins them; cli: the flags.
"""
