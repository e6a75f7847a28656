"""The control plane's protocol: typed messages, store keys, the job's key and seals.

Standard library only: the coordinator, agents, workers, shadows and the simulator's tests all
speak it, and none of them needs torch to read a record.
"""

from spotpipe.protocol import keys
from spotpipe.protocol.auth import (Refused, ReplayGuard, Sealed, Sealer, job_key,
                                    new_instance_id, proof, same_secret, token_bytes,
                                    token_from_env, unseal)
from spotpipe.protocol.channel import Channel, Opened, channel_from_env
from spotpipe.protocol.messages import (Abort, CheckpointSaved, Close, CoordinatorState,
                                        DecisionRecord, Event, Exit, Journal, Heartbeat, JoinAnswer, JoinRequest, Kill, Mark, Message,
                                        MessageError, Metrics, Regroup, Report, parse)

__all__ = ["Abort", "Channel", "channel_from_env", "CheckpointSaved", "Close", "CoordinatorState", "DecisionRecord", "Event", "Exit",
           "Heartbeat", "JoinAnswer", "JoinRequest", "Journal", "Kill", "Mark", "Message", "MessageError",
           "Metrics", "Opened", "Refused", "Regroup", "Report", "ReplayGuard", "Sealed",
           "Sealer", "job_key", "keys", "new_instance_id", "parse", "proof", "same_secret",
           "token_bytes", "token_from_env", "unseal"]
