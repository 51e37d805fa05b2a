"""Hand-written task templates and subjects for the self-distillation prompt source.

Everything here was written for specpipe. Each category pairs a few task templates (with a
`{}` slot) with a list of subjects; `specpipe.distill.prompts` samples the product. The subject
lists are deliberately broad and everyday: the corpus should look like what people ask a small
chat model, so that the target's own answers to it resemble its answers at benchmark time.
"""
from __future__ import annotations

# ---- writing -------------------------------------------------------------------------------
WRITING_TEMPLATES = [
    "Write a short poem about {}.",
    "Write a short story of about 200 words about {}.",
    "Write a blog post introduction about {}.",
    "Write a persuasive paragraph about {}.",
    "Write a haiku about {}.",
    "Write a short newsletter article about {}.",
    "Write the opening paragraph of a novel that begins with {}.",
    "Write a motivational message about {}.",
    "Write a funny limerick about {}.",
    "Write a diary entry about {}.",
    "Write a short speech for a school assembly about {}.",
]
WRITING_SUBJECTS = [
    "a rainy Monday morning", "a lost umbrella", "the smell of fresh bread", "a lighthouse in winter",
    "learning to ride a bicycle", "an old family recipe", "the first day at a new job", "a city at night",
    "a cat that refuses to come inside", "a forgotten garden", "moving to a new country",
    "a long train journey", "the last day of summer", "a friendship that started online",
    "a broken alarm clock", "a small bookshop", "planting a tree", "a power cut during a storm",
    "a street musician", "a grandmother's old radio", "a mountain sunrise", "a school science fair",
    "a surprise birthday party", "a dog learning a new trick", "the sound of the ocean",
    "a farmer's market", "a quiet library", "running a first marathon", "the changing seasons",
    "a village festival", "a letter that arrived twenty years late", "a robot learning to paint",
    "a neighbourhood clean-up day", "recycling at home", "a vegetable garden on a balcony",
    "a snow day", "an unexpected phone call", "a bus that never comes", "a childhood treehouse",
    "a busy airport", "the importance of sleep", "saving money", "volunteering at an animal shelter",
    "a camping trip gone wrong", "a new pair of running shoes", "a noisy upstairs neighbour",
    "a coffee shop on a corner", "the first snowflake", "a kite on a windy beach",
    "a music teacher who changed a student's life", "a river flowing through a town",
    "a secret map found in an attic", "a power outage in a big city", "a long-distance friendship",
    "the joy of cooking for friends", "a stray kitten", "a hot air balloon ride", "a desert at night",
    "a scientist's late-night discovery", "a fishing boat at dawn", "a family road trip",
    "the benefits of reading every day", "walking to work", "a wedding in the rain",
    "a chess game in the park",
]
REVIEW_TEMPLATES = [
    "Write a short product review of {}.",
    "Write an honest customer review of {}, with one thing you liked and one you did not.",
]
REVIEW_SUBJECTS = [
    "a new smartphone", "a pair of noise-cancelling headphones", "an electric scooter",
    "a cheap coffee maker", "a reusable water bottle", "a robot vacuum cleaner", "a fitness tracker",
    "a camping tent", "an air fryer", "a standing desk", "an e-book reader", "a mechanical keyboard",
    "a pair of hiking boots", "a budget laptop", "a smart doorbell", "a children's bicycle",
]

EMAIL_TEMPLATES = [
    "Write a polite email to {}.",
    "Write a short, friendly message to {}.",
    "Write a formal letter to {}.",
]
EMAIL_SUBJECTS = [
    "a landlord asking for a broken heater to be repaired", "a teacher explaining a child's absence",
    "a manager asking for a day off next Friday", "a colleague thanking them for their help on a project",
    "a customer apologising for a late delivery", "a neighbour about a noisy party",
    "a hotel asking to change a booking", "a professor asking for an extension on an essay",
    "a gym cancelling a membership", "a friend inviting them to a barbecue",
    "a client following up on an unpaid invoice", "a recruiter declining a job offer",
    "a school asking about after-school clubs", "the city council about a broken streetlight",
    "an airline asking for a refund for a cancelled flight", "a team announcing a new meeting time",
    "a supplier asking for a price quote", "a former coworker asking for a reference",
    "a restaurant complaining about a wrong order", "a book club suggesting the next book",
    "new employees welcoming them to the company", "parents about a school trip",
    "a bank reporting a lost card", "an online shop asking about a missing parcel",
    "a plumber asking for an appointment", "a conference declining an invitation to speak",
]

# ---- roleplay ------------------------------------------------------------------------------
ROLEPLAY_TEMPLATES = [
    "Pretend you are {}. Introduce yourself and describe your typical day.",
    "You are {}. A visitor asks you for advice. What do you tell them?",
    "Act as {} and explain what you love most about your work.",
    "Imagine you are {}. Describe the biggest challenge you faced this week.",
    "Role-play as {} greeting a newcomer for the first time.",
    "Stay in character as {} and answer this: what should I never do around you?",
]
ROLEPLAY_PERSONAS = [
    "a pirate captain", "a medieval blacksmith", "a wise old wizard", "a friendly robot butler",
    "a detective in 1920s London", "a nervous first-time astronaut", "a cheerful kindergarten teacher",
    "a grumpy cat", "a barista at a busy cafe", "a park ranger in a national park",
    "a Roman soldier", "a chef in a five-star restaurant", "a librarian in a haunted library",
    "a time traveller from the year 3000", "a lighthouse keeper", "a taxi driver in New York",
    "a professional football coach", "a travel agent", "a tech support agent",
    "a dragon guarding a treasure", "a zookeeper", "a famous magician", "a personal trainer",
    "a shy ghost", "a museum curator", "a submarine captain", "a fortune teller",
    "a village baker", "an ancient Egyptian scribe", "a customer service chatbot",
    "a mountain guide", "a tired superhero", "a space station engineer", "a real estate agent",
    "a knight on a quest", "a nurse on a night shift", "a fisherman", "a school principal",
    "a tour guide in Rome", "a farmer", "a wedding planner", "a game show host",
    "a retired spy", "a beekeeper", "a sommelier", "a taxi-driving alien", "a talking tree",
    "a Victorian butler", "a news reporter at a storm", "a career counsellor",
]

# ---- coding --------------------------------------------------------------------------------
CODING_TASKS = [
    "reverses a linked list", "checks whether a number is prime", "counts the vowels in a string",
    "finds the second largest number in a list", "removes duplicates from a list while keeping order",
    "merges two sorted lists into one sorted list", "computes the factorial of a number",
    "returns the n-th Fibonacci number", "checks whether two strings are anagrams",
    "converts a temperature from Celsius to Fahrenheit", "finds the most common word in a text",
    "flattens a nested list", "checks whether brackets in a string are balanced",
    "computes the greatest common divisor of two numbers", "sorts a list of dictionaries by a key",
    "converts a Roman numeral to an integer", "finds all pairs in a list that sum to a target",
    "rotates a list by k positions", "transposes a matrix", "computes a moving average",
    "validates an email address", "capitalises the first letter of every word",
    "counts the lines in a file", "finds the longest common prefix of a list of strings",
    "implements binary search", "implements bubble sort", "implements a queue using two stacks",
    "reads a CSV file and prints the average of a column", "generates a random password",
    "checks whether a year is a leap year", "converts a binary string to an integer",
    "finds the missing number in a list from 1 to n", "groups words by their first letter",
    "computes the sum of the digits of a number", "finds the intersection of two lists",
    "counts how often each character appears in a string", "checks whether a list is sorted",
    "splits a list into chunks of size n", "returns the median of a list of numbers",
    "converts a date string from DD/MM/YYYY to YYYY-MM-DD", "implements a simple LRU cache",
    "computes the power set of a set", "finds the maximum subarray sum",
    "parses a query string into a dictionary", "computes the edit distance between two strings",
    "draws a triangle of stars of a given height", "implements FizzBuzz",
    "computes the area of a circle from its radius", "finds the longest word in a sentence",
    "checks whether a number is a perfect square", "converts a number to words",
    "merges two dictionaries", "counts the number of islands in a grid",
    "finds the first non-repeating character in a string", "implements depth-first search on a graph",
    "implements breadth-first search on a graph", "computes compound interest",
    "shuffles a deck of cards", "simulates rolling two dice a thousand times",
]
CODING_LANGUAGES = ["Python", "JavaScript", "Java", "C", "C++", "Go", "Rust", "TypeScript", "Ruby", "C#"]
CODING_TEMPLATES = [
    "Write a {language} function that {task}.",
    "How do I write a {language} program that {task}? Please explain the code.",
    "Show me a short {language} example that {task}, with comments.",
]
CODING_CONCEPTS = [
    "recursion", "a closure", "a hash map", "Big O notation", "a REST API", "object-oriented programming",
    "inheritance", "polymorphism", "an interface", "a linked list", "a binary tree", "a stack",
    "a queue", "a generator in Python", "a decorator in Python", "list comprehensions", "unit testing",
    "version control with Git", "a merge conflict", "a pull request", "a race condition", "a deadlock",
    "garbage collection", "a memory leak", "a null pointer exception", "an SQL join",
    "database indexing", "a primary key", "caching", "a virtual machine", "a container",
    "an API key", "JSON", "regular expressions", "asynchronous programming", "a callback",
    "a promise in JavaScript", "exception handling", "type hints in Python", "a compiler",
    "an interpreter", "dynamic programming", "a greedy algorithm", "a sorting algorithm",
    "hashing passwords", "a function signature", "immutability", "a pure function",
    "a global variable", "the difference between a list and a tuple in Python",
]
CODING_CONCEPT_TEMPLATES = [
    "Explain {} to a beginner programmer.",
    "What is {} and when should I use it? Give a short example.",
    "What are common mistakes people make with {}?",
]
SQL_TASKS = [
    "lists all customers who placed more than three orders",
    "finds the average price of products in each category",
    "returns the ten most recent orders",
    "counts how many employees work in each department",
    "finds products that have never been ordered",
    "shows the total sales per month for the last year",
    "finds duplicate email addresses in a users table",
    "returns the top three students by grade in each class",
    "deletes all sessions older than thirty days",
    "lists authors together with the number of books they wrote",
]

# ---- stem ----------------------------------------------------------------------------------
STEM_TEMPLATES = [
    "Explain {} in simple terms.",
    "Tell me about {}, with an everyday example.",
    "Explain {} to a high school student.",
    "Why is it important to understand {}?",
    "Describe {} in three short paragraphs.",
    "What are the most common misconceptions about {}?",
]
STEM_CONCEPTS = [
    "photosynthesis", "gravity", "the water cycle", "plate tectonics", "natural selection",
    "the speed of light", "black holes", "the greenhouse effect", "electric current", "magnetism",
    "the periodic table", "chemical bonds", "acids and bases", "DNA replication", "cell division",
    "the immune system", "antibiotic resistance", "vaccines", "the human heart", "the nervous system",
    "the digestive system", "sound waves", "the Doppler effect", "friction", "Newton's laws of motion",
    "kinetic and potential energy", "the law of conservation of energy", "nuclear fission",
    "nuclear fusion", "solar panels", "wind turbines", "batteries", "semiconductors", "transistors",
    "the internet", "encryption", "machine learning", "neural networks", "climate change",
    "ocean currents", "the ozone layer", "volcanoes", "earthquakes", "tides", "the phases of the Moon",
    "the seasons", "rainbows", "static electricity", "thermodynamics", "entropy", "osmosis",
    "enzymes", "hormones", "the carbon cycle", "the nitrogen cycle", "ecosystems", "food chains",
    "biodiversity", "genetic mutations", "stem cells", "viruses", "bacteria", "the scientific method",
    "probability", "statistics", "prime numbers", "the Pythagorean theorem", "calculus", "derivatives",
    "integrals", "logarithms", "exponential growth", "vectors", "matrices", "infinity",
    "the number pi", "fractals", "radioactivity", "half-life", "the Big Bang", "exoplanets",
    "the solar system", "comets", "dark matter", "quantum mechanics", "relativity", "superconductors",
    "lasers", "fibre optics", "3D printing", "GPS", "radar", "refrigerators", "microwave ovens",
    "airplane lift", "rockets", "sleep", "memory in the brain", "caffeine", "blood types",
]
STEM_COMPARISONS = [
    ("weather", "climate"), ("a virus", "a bacterium"), ("mass", "weight"), ("speed", "velocity"),
    ("an atom", "a molecule"), ("mitosis", "meiosis"), ("AC", "DC electricity"), ("heat", "temperature"),
    ("a comet", "an asteroid"), ("fission", "fusion"), ("RAM", "storage"), ("an element", "a compound"),
    ("a hurricane", "a tornado"), ("renewable", "non-renewable energy"), ("a star", "a planet"),
    ("correlation", "causation"), ("mean", "median"), ("series", "parallel circuits"),
    ("aerobic", "anaerobic respiration"), ("a hypothesis", "a theory"),
]

# ---- humanities ----------------------------------------------------------------------------
HUMANITIES_TEMPLATES = [
    "Give a short overview of {}.",
    "What were the main causes and consequences of {}?",
    "Why do people still discuss {} today?",
    "Explain {} to someone who has never studied it.",
    "Summarise the key ideas of {} in a few paragraphs.",
    "What can we learn today from {}?",
]
HUMANITIES_TOPICS = [
    "the Renaissance", "the Industrial Revolution", "the fall of the Berlin Wall", "the Cold War",
    "the Roman Republic", "ancient Greek democracy", "the Silk Road", "the Black Death",
    "the American Revolution", "the Reformation", "the Enlightenment", "the Meiji Restoration",
    "the Ottoman Empire", "the Mongol Empire", "the age of exploration", "the Great Depression",
    "the civil rights movement", "the women's suffrage movement", "the invention of writing",
    "the Magna Carta", "the founding of the United Nations", "decolonisation in Africa",
    "the Cuban Missile Crisis", "the space race", "the Aztec civilisation", "the Inca road system",
    "the Viking age", "feudalism", "the printing revolution", "the Scientific Revolution",
    "utilitarianism", "existentialism", "Stoic philosophy", "Plato's allegory of the cave",
    "Kant's categorical imperative", "the social contract", "Confucianism", "Buddhist ethics",
    "free will", "the trolley problem", "supply and demand", "inflation", "globalisation",
    "the tragedy of the commons", "game theory", "behavioural economics", "the gig economy",
    "minimalism in art", "Cubism", "Baroque music", "jazz", "Shakespeare's tragedies",
    "Greek mythology", "the hero's journey", "magical realism", "the Romantic poets",
    "the Harlem Renaissance", "Gothic architecture", "the history of the Olympic Games",
    "the history of coffee", "the invention of money", "urbanisation", "the history of the internet",
    "propaganda in the twentieth century", "the role of museums", "language change over time",
    "the spread of English as a world language", "human rights", "separation of powers",
    "federalism", "the welfare state", "public opinion", "cultural relativism", "the ethics of AI",
]
HUMANITIES_QUESTIONS = [
    "What makes a good leader?", "Is it ever right to break the law?", "Why do people believe in myths?",
    "What is the purpose of art?", "Should museums return artefacts to their countries of origin?",
    "How does social media change politics?", "Why do empires collapse?",
    "What is the value of studying history?", "Is happiness the goal of life?",
    "Should voting be compulsory?", "What is the difference between ethics and morals?",
    "How do languages die?", "Why do we tell stories?", "What makes a city livable?",
    "Is economic growth always good?", "What is a fair wage?", "Can a novel change society?",
    "Why do some traditions last for centuries?", "What is cultural heritage?",
    "Should homework be banned?", "Are people naturally good?", "What is the role of a free press?",
]

# ---- everyday advice (spread over writing / humanities / stem by topic) -------------------------
ADVICE_TEMPLATES = [
    "Give me some tips for {}.",
    "What is the best way to get started with {}?",
    "I want to improve at {}. Can you make a simple plan for the next four weeks?",
]
ADVICE_TOPICS = [
    "public speaking", "studying for exams", "learning a new language", "time management",
    "cooking healthy meals on a budget", "sleeping better", "running", "saving money",
    "writing a CV", "job interviews", "keeping houseplants alive", "meditation", "drawing",
    "photography with a phone", "learning guitar", "making friends in a new city",
    "working from home", "negotiating a salary", "reducing screen time", "decluttering a home",
    "learning to code", "reading more books", "staying motivated", "gardening",
    "training a puppy", "giving feedback to colleagues", "planning a wedding", "hiking safely",
    "baking bread", "managing stress",
]

# ---- a second set of subjects (session 31) ---------------------------------------------------
# Own lists with their own builders (`*_2` in specpipe.distill.prompts.BUILDERS): appending to the
# lists above would reorder their template x subject products and change every prompt already drawn.
WRITING_SUBJECTS_2 = [
    "an empty playground at dusk", "a broken-down car on a country road", "the first cup of tea of the day",
    "a child's lost teddy bear", "a crowded night market", "a postcard from a stranger", "an old typewriter",
    "a rooftop garden in the city", "a fox crossing a motorway bridge", "the sound of rain on a tin roof",
    "a ferry crossing in fog", "a grandfather teaching chess", "a market stall selling spices",
    "a repair shop for old clocks", "a dog waiting at the station", "the night before an exam",
    "a swimming pool in winter", "a mural painted by a whole street", "a kitchen after a big family dinner",
    "a stargazing night in the desert", "a village without mobile signal", "a paper boat in a gutter",
    "a forgotten voicemail", "a queue at the post office", "a bakery that opens at four in the morning",
    "a band's first concert", "a canoe trip on a quiet lake", "a library book returned forty years late",
    "a heatwave in a northern town", "the last tram of the night", "a community choir",
    "a beach after a storm", "an orchard at harvest time", "a wind farm on a hill",
    "moving out of a childhood home", "a rescue horse", "a lost hiker finding the path",
    "a garage turned into a studio", "a family photo album", "a snowed-in mountain cabin",
    "an argument between two robots", "a bicycle courier's busy day", "a tiny island with one shop",
    "a museum at night", "a letter to your future self", "a balloon that escaped a birthday party",
    "a nurse's first day on a ward", "a storm over a harbour", "a cat that rides the bus",
    "a town that celebrates the first frost", "learning to swim as an adult", "a rainy school sports day",
    "a street food vendor", "an astronaut's last night on Earth", "the smell of old books",
    "a carpenter's workshop", "a garden gnome that moves at night", "a bridge between two villages",
    "a teenager's first paycheck", "a year without the internet",
]
ROLEPLAY_PERSONAS_2 = [
    "a lighthouse cat", "a ship's cook on a long voyage", "a ballet teacher", "a train conductor on a night train",
    "a stage manager on opening night", "a desert nomad guide", "a museum security guard",
    "a polar researcher", "a hotel concierge", "a village postmaster", "a clockmaker",
    "a radio DJ at 3 a.m.", "a veterinary nurse", "a mountain hut keeper", "a court jester",
    "an airline pilot", "a florist on Valentine's Day", "a volcano scientist", "a toy shop owner",
    "a city bus driver", "a lifeguard", "a puppeteer", "a hot air balloon pilot", "a bookshop cat",
    "a shepherd", "an archaeologist at a dig", "a sushi chef", "a deep-sea diver",
    "a sports commentator", "a librarian on a mobile library bus", "a robot learning to cook",
    "a snow plough driver", "a street artist", "a bicycle mechanic", "a ghost tour guide",
    "a tailor", "a marathon volunteer", "a kite maker", "an elderly village storyteller",
    "a customs officer at a small airport",
]
STEM_CONCEPTS_2 = [
    "buoyancy", "surface tension", "air pressure", "the water table", "erosion", "glaciers",
    "the rock cycle", "fossils", "coral reefs", "photosynthesis in algae", "pollination", "seed dispersal",
    "migration of birds", "hibernation", "camouflage in animals", "the human eye", "hearing",
    "muscles and bones", "the lungs", "the kidneys", "blood pressure", "cholesterol", "allergies",
    "fever", "the placebo effect", "circadian rhythms", "nutrition labels", "fermentation", "yeast",
    "catalysts", "oxidation and rust", "polymers", "plastics recycling", "desalination",
    "hydroelectric power", "geothermal energy", "electric cars", "hydrogen fuel", "power grids",
    "smartphone touchscreens", "Wi-Fi", "Bluetooth", "cloud computing", "compression of files",
    "binary numbers", "algorithms", "sorting", "databases", "computer viruses", "passwords and hashing",
    "satellites", "the International Space Station", "the Moon landing", "Mars rovers", "meteor showers",
    "eclipses", "the northern lights", "telescopes", "microscopes", "the metric system",
    "significant figures", "percentages", "fractions", "negative numbers", "the golden ratio",
    "symmetry", "graphs of functions", "simple interest", "random sampling", "the bell curve",
]
HUMANITIES_TOPICS_2 = [
    "the Han dynasty", "the Maurya Empire", "ancient Mesopotamia", "the Phoenicians", "the Byzantine Empire",
    "the Crusades", "the Hundred Years' War", "the Spanish Armada", "the Dutch Golden Age",
    "the French Revolution", "the Napoleonic Wars", "the unification of Italy", "the abolition of slavery",
    "the Irish potato famine", "the California gold rush", "the Russian Revolution", "the Weimar Republic",
    "the partition of India", "the Marshall Plan", "the Apollo programme", "apartheid in South Africa",
    "the European Union", "the Arab Spring", "the history of vaccination", "the history of the bicycle",
    "the history of chocolate", "the history of tea", "the history of maps", "the history of timekeeping",
    "the history of libraries", "Impressionism", "Surrealism", "the Bauhaus", "Art Nouveau",
    "classical music of the Romantic era", "the blues", "hip hop culture", "folk tales",
    "Norse mythology", "epic poetry", "the sonnet", "science fiction as a genre", "detective novels",
    "the theatre of ancient Greece", "Japanese haiku", "calligraphy", "stoicism in daily life",
    "virtue ethics", "the philosophy of Socrates", "the idea of progress", "nationalism",
    "democracy and its critics", "the rule of law", "taxation", "trade unions", "consumerism",
    "tourism and its effects", "the history of advertising", "the origins of the calendar",
    "oral history",
]
ADVICE_TOPICS_2 = [
    "learning to swim", "budgeting for a holiday", "preparing for a first marathon", "learning to knit",
    "writing a short story", "starting a podcast", "keeping a journal", "eating more vegetables",
    "waking up earlier", "learning to touch type", "organising a small event", "caring for an elderly parent",
    "moving house", "learning to drive", "starting a vegetable patch", "making a good first impression",
    "speaking up in meetings", "learning chess", "buying a used car", "cycling to work",
    "cooking for a large group", "reducing food waste", "keeping a tidy desk", "learning to paint with watercolours",
    "preparing for a long flight", "looking after a new kitten", "practising gratitude", "learning to sing",
    "studying maths", "writing better emails", "teaching a child to read", "planning a road trip",
    "running a book club", "learning sign language", "making a budget spreadsheet", "starting to do yoga",
    "preparing for a job fair", "dealing with a difficult neighbour", "learning to juggle",
    "becoming a volunteer",
]

# ---- extraction: pieces for synthetic documents -------------------------------------------
FIRST_NAMES = [
    "Anna", "Bruno", "Chen", "Dalia", "Emil", "Fatima", "Gustav", "Hana", "Ivan", "Julia", "Kofi",
    "Lucia", "Mateo", "Nadia", "Omar", "Priya", "Quentin", "Rosa", "Sven", "Tara", "Umar", "Vera",
    "Wei", "Ximena", "Yusuf", "Zoe", "Aiko", "Bilal", "Carmen", "Dmitri", "Elena", "Farid",
]
LAST_NAMES = [
    "Almeida", "Brandt", "Costa", "Dubois", "Eriksson", "Fischer", "Garcia", "Haddad", "Ito", "Jensen",
    "Kowalski", "Lopez", "Moreau", "Novak", "Okafor", "Petrov", "Quinn", "Rossi", "Schmidt", "Tanaka",
    "Usman", "Varga", "Weber", "Yilmaz", "Zhang",
]
CITIES = [
    "Lyon", "Osaka", "Nairobi", "Bergen", "Valencia", "Toronto", "Adelaide", "Gdansk", "Porto",
    "Cape Town", "Hamburg", "Montreal", "Seoul", "Lima", "Bologna", "Edinburgh", "Dublin", "Tbilisi",
    "Quito", "Ljubljana", "Marseille", "Bangalore", "Hanoi", "Cork", "Leeds", "Utrecht", "Graz",
]
COMPANIES = [
    "Northwind Tools", "Bluefin Analytics", "Maple & Oak Furniture", "Solara Energy", "Quickship Logistics",
    "Helix Biotech", "Riverbend Bakery", "Crestline Outdoor", "Pixelforge Games", "Harbor Dental Clinic",
    "Silverline Travel", "Greenway Grocers", "Orbit Telecom", "Lumen Lighting", "Tidewater Insurance",
]
PRODUCTS = [
    ("wireless mouse", 24.99), ("desk lamp", 39.5), ("notebook", 3.2), ("yoga mat", 29.0),
    ("coffee grinder", 54.9), ("backpack", 65.0), ("water bottle", 12.5), ("USB-C cable", 9.99),
    ("bluetooth speaker", 79.0), ("kettle", 34.75), ("pair of gloves", 18.0), ("phone case", 15.49),
    ("paperback novel", 11.95), ("plant pot", 8.4), ("bike light", 22.0), ("sketchbook", 13.6),
]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
JOB_TITLES = [
    "project manager", "software engineer", "sales director", "data analyst", "office manager",
    "marketing lead", "chief financial officer", "head of design", "operations coordinator",
    "research scientist", "customer success manager", "intern",
]
EVENTS = [
    "the product launch", "the quarterly review", "the team offsite", "the budget meeting",
    "the charity run", "the annual conference", "the office move", "the client workshop",
    "the hiring day", "the safety inspection",
]

# ---- second turns ------------------------------------------------------------------------------
# Generic follow-up requests, by the first turn's category: a chat's second turn asks the model to
# rework, extend or check its own first answer, so the corpus also holds answers written with an
# earlier answer in the context (half of a two-turn chat benchmark's tokens are such answers).
FOLLOW_UPS = {
    "writing": [
        "Shorten it to about half its length without losing the main point.",
        "Rewrite it in a more formal register suitable for a professional audience.",
        "Now give it a catchy title and explain why you chose it.",
        "Rewrite the opening so that it grabs the reader's attention immediately.",
        "Make the tone warmer and more personal.",
        "Turn it into a numbered list of the key points.",
        "Write a version of it aimed at young children.",
        "Add a closing sentence that invites the reader to respond.",
        "What would you change if this were going to be read aloud on the radio?",
        "Rewrite it using simpler words and shorter sentences.",
        "Point out the weakest sentence and improve it.",
        "Write a two-sentence summary of what you wrote.",
    ],
    "roleplay": [
        "Stay in character and describe what you do next.",
        "Someone interrupts you with a rude remark. How do you react, still in character?",
        "Now describe the same moment from the other person's point of view.",
        "Continue the scene, but this time something unexpected happens.",
        "I have a question for you: what worries you most right now?",
        "Tell me a short story from your past that explains why you act this way.",
        "End the conversation politely, still in character.",
        "Describe your surroundings in more detail.",
        "Give me one piece of advice, in your own voice.",
        "How would you explain your decision to a child?",
    ],
    "reasoning": [
        "Go through your reasoning again step by step and check each step.",
        "Is there another way to reach the same answer? Show it.",
        "What assumption does your answer rely on, and what changes if it is false?",
        "Make up a simpler puzzle of the same kind and solve it.",
        "How confident are you in your answer, and why?",
        "Which step of this would most people get wrong?",
        "Change one detail of the problem and solve the new version.",
        "Sum up the solution in two sentences.",
    ],
    "math": [
        "Verify your result with a different method.",
        "Explain each step in plain words for someone who finds algebra hard.",
        "What would the answer be if all the numbers were doubled?",
        "Write a similar problem with different numbers and solve it.",
        "Round your answer to two decimal places and state the units.",
        "Show the calculation as a short Python snippet.",
        "Where could a rounding error creep into this calculation?",
        "Which formula did you use, and why does it apply here?",
    ],
    "coding": [
        "Add comments that explain the tricky parts of the code.",
        "Write a few unit tests for it.",
        "What are the time and space complexity of your solution?",
        "Rewrite it in another programming language of your choice.",
        "How should it handle invalid input? Update the code accordingly.",
        "Refactor it so that it is easier to read.",
        "Can you make it faster? Explain what you changed.",
        "Show how to call it and what it prints.",
        "Which edge cases should be tested?",
        "Explain the code line by line to a beginner.",
    ],
    "extraction": [
        "Present the same information as a JSON object.",
        "Put the extracted details into a Markdown table.",
        "Which piece of information was the hardest to find, and why?",
        "List only the dates that are mentioned, in chronological order.",
        "Check your extraction again: did you miss anything?",
        "Turn the result into a short plain-English summary.",
        "Which fields that one might expect are missing from the text?",
        "Sort the extracted items alphabetically.",
    ],
    "stem": [
        "Explain it again using an everyday analogy.",
        "What is a common misconception about this?",
        "Give a real-world application of this idea.",
        "How could this be demonstrated with a simple experiment?",
        "Explain it to a ten-year-old.",
        "What open questions do scientists still have about this?",
        "Write three quiz questions about it, with answers.",
        "How was this discovered?",
    ],
    "humanities": [
        "What would a critic of this view say?",
        "Give a concrete historical example that illustrates your point.",
        "How does this compare with the situation today?",
        "Sum up the main argument in one paragraph.",
        "Recommend two books for someone who wants to learn more.",
        "Which perspective is missing from your answer?",
        "Explain why this topic still matters.",
        "Write three discussion questions for a class on this topic.",
    ],
    "advice": [
        "What if I only have ten minutes a day for this?",
        "Which of these tips should I start with, and why?",
        "What mistakes do people usually make here?",
        "Make it into a one-week plan.",
        "How would this advice change for someone on a tight budget?",
        "How will I know whether it is working?",
    ],
}
