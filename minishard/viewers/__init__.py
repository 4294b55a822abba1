"""The viewers of a trace: the step-through player's data, the offline HTML player, Perfetto.

    playback.py         what the player shows at each event (the ledger replayed, byte formats)
    offline_player.py   one HTML file that plays a trace with no server (offline_player.js)
    perfetto.py         the trace as Chrome / Perfetto JSON
"""
