"""Loading a real model: finding and opening it, the plan and memory check before any weight is
read, and the allocator settings of the loaded process."""
