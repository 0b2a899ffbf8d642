"""The prefix cache's block events, published in vLLM's `--kv-events-config` format
(ZeroMQ PUB + msgpack) for external KV-aware routers (llm-d, Dynamo).

    publisher = KVEventPublisher(KVEventsConfig.from_json(text))
    publisher.publish([*block_manager_log.drain(), *tier_log.drain()], block_size)  # each tick, never waits

The pool's events go out in medium "GPU", the tier writer's (kv_transfer/tiers/events.py)
in their tier's ("CPU", "DISK", "REMOTE": wire.py).

config.py: the flag (no zmq: the CLI reads it); wire.py: the frames and their layout;
publisher.py: the queue, the thread and the sockets.
"""
