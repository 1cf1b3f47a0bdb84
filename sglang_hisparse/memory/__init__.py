"""Where every KV row lives: logical ids and the device, host and hot-buffer rows behind them.

The allocator hands out logical ids and device rows; hot buffers, residency and the host mirror
own the rows of decoding requests; admission says which requests a server can ever take. Imports
point down only (to resolver/ and the ground floor), never to decode/ or serving/.
"""
